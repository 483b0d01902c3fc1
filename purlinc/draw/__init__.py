"""Drawing SNAC schedules (``purlinc draw``): the schedule view, the modelled timeline, and
device traces laid over the schedule.

    model.py     Schedule -> Drawing (lanes, step boxes, Notify -> Wait pairs, collapsed channels)
    timeline.py  Drawing -> x positions: columns, or microseconds from a cost model
    svg.py       panels -> SVG text;  html.py: the SVG in a page with hover details
    trace.py     the trace JSON (schema, validation) and measured times per step
    render.py    what the CLI calls: file + options -> SVG or HTML text
    defaults.py  defaults and limits the CLI reads without importing the rest
"""
