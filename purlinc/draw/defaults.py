"""The drawing's defaults and limits, in a module with no imports: the command line reads them
to build its parser (help texts, --width's check) without importing the drawing itself."""

DEFAULT_WORLD_SIZE = 8  # without --ranks (a trace gives its own)
DEFAULT_DTYPE = "bfloat16"  # the timeline's element type without --dtype
# The narrowest timeline, in pixels: the lane labels (svg.LABEL_W), a margin, and room for
# the time axis itself.  ``purlinc draw --width`` refuses less; svg._scale never uses less.
MIN_WIDTH = 400
# The widest: a browser draws nothing at all past some tens of millions of pixels (a page of
# 10^9 came out blank, heading included), and no screen or print reads a timeline that long.
MAX_WIDTH = 100_000
# The largest message a timeline models, per rank's buffer (--bytes, or --count elements): 1 TiB,
# more than any GPU holds.  A 400-digit count failed in the float arithmetic of the layout, and
# 10^23 drew an axis of 10^19 us.
MAX_TIMELINE_BYTES = 1 << 40
# The most step boxes one drawing holds (every panel together).  About 650-720 bytes each: at
# this a page is about 70 MB, its boxes narrower than a pixel on a timeline, and a browser
# struggles to open it (allreduce at R=48, direct-push: 115,104 boxes).  A schedule too large
# to build a drawing of at all is refused earlier (model.MAX_DRAWN_STEPS).
MAX_BOXES = 100_000
