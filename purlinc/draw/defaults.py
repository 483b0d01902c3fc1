"""The drawing's defaults and limits, in a module with no imports: the command line reads them
to build its parser (help texts, --width's check) without importing the drawing itself."""

DEFAULT_WORLD_SIZE = 8  # without --ranks (a trace gives its own)
DEFAULT_DTYPE = "bfloat16"  # the timeline's element type without --dtype
# The narrowest timeline, in pixels: the lane labels (svg.LABEL_W), a margin, and room for
# the time axis itself.  ``purlinc draw --width`` refuses less; svg._scale never uses less.
MIN_WIDTH = 400
