"""A drawing as one self-contained HTML page: the SVG inline, plus hover details.

Hovering a step shows its full text (operands, note, .pln line, model or measured times)
in a box that follows the pointer, and highlights the arrows into and out of it; the SVG
``<title>`` of each step still gives the browser's own tooltip without JavaScript.
"""

from __future__ import annotations

from xml.sax.saxutils import escape

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 12px; }}
#wrap {{ overflow: auto; border: 1px solid #ccc; }}
.step:hover rect {{ stroke-width: 2.5; }}
path.arrow.hot {{ stroke: #d62728; stroke-opacity: 1; stroke-width: 2.5; }}
#tip {{ position: fixed; display: none; pointer-events: none; background: #fffff0; border: 1px solid #888;
        padding: 4px 6px; font: 12px monospace; white-space: pre; box-shadow: 2px 2px 4px #0003; z-index: 2; }}
</style>
</head>
<body>
<h3>{title}</h3>
<p>{caption}</p>
<div id="wrap">
{svg}
</div>
<div id="tip"></div>
<script>
(function () {{
  const tip = document.getElementById("tip");
  function key(g) {{ return [g.dataset.rank, g.dataset.channel, g.dataset.index].join(","); }}
  document.querySelectorAll("g.step").forEach(function (g) {{
    const panel = g.closest("g.panel");
    g.addEventListener("mousemove", function (e) {{
      tip.textContent = g.dataset.detail;
      tip.style.display = "block";
      tip.style.left = (e.clientX + 14) + "px";
      tip.style.top = (e.clientY + 14) + "px";
    }});
    g.addEventListener("mouseenter", function () {{
      const k = key(g);
      panel.querySelectorAll("path.arrow").forEach(function (a) {{
        if (a.dataset.notify === k || a.dataset.wait === k) a.classList.add("hot");
      }});
    }});
    g.addEventListener("mouseleave", function () {{
      tip.style.display = "none";
      panel.querySelectorAll("path.arrow.hot").forEach(function (a) {{ a.classList.remove("hot"); }});
    }});
  }});
}})();
</script>
</body>
</html>
"""


def render(svg: str, *, title: str, caption: str = "") -> str:
    # The SVG goes in as is (it is our own, well-formed XML); only its XML prolog, if any, is dropped.
    body = svg.split("?>", 1)[1] if svg.startswith("<?xml") else svg
    caption = caption or "Hover a step for its operands, note, .pln line and times; its arrows turn red."
    return _PAGE.format(title=escape(title), caption=escape(caption), svg=body.strip())
