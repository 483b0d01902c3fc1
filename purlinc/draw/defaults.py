"""The drawing's defaults and limits, in a module with no imports: the command line reads them
to build its parser (help texts, --width's check) without importing the drawing itself."""

DEFAULT_WORLD_SIZE = 8  # without --ranks (a trace gives its own)
DEFAULT_DTYPE = "bfloat16"  # the timeline's element type without --dtype
# The narrowest timeline, in pixels: the lane labels (svg.LABEL_W), a margin, and room for
# the time axis itself.  ``purlinc draw --width`` refuses less; svg._scale never uses less.
MIN_WIDTH = 400
# The most step boxes one drawing holds (every panel together).  About 550 bytes each: past
# this a page is over 50 MB, its boxes narrower than a pixel on a timeline, and a browser
# struggles to open it (allreduce at R=48, direct-push: 115,104 boxes).  A schedule too large
# to build a drawing of at all is refused earlier (model.MAX_DRAWN_STEPS).
MAX_BOXES = 100_000
