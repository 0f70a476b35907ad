"""A plotly figure as one HTML file that draws offline, with plotly.js stored gzip-compressed.

MLflow's artifact viewer shows an HTML artifact as a ``blob:`` document in an iframe sandboxed
to scripts only (an opaque origin). Inside it a relative link to a sibling artifact does not
resolve, and an absolute one would bind the figure to the server's address at logging time and
need the password-protected server's credentials from that frame. So each figure carries its own
plotly.js, as plotly's ``to_html(include_plotlyjs=True)`` does, but gzip-compressed and base64
encoded (about 2.0 MB instead of 4.8 MB). A few lines of JavaScript inflate it with the browser's
``DecompressionStream`` (Chrome 80, Firefox 113, Safari 16.4 and later), run it and draw the
figure from its JSON. The same file opens from disk, offline.
"""

from __future__ import annotations

import base64
import functools
import gzip
import html
import json
from typing import Any

_LOADER = """(async () => {
  const packed = document.getElementById("plotly-js-gzip").textContent;
  const bytes = Uint8Array.from(atob(packed), c => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  const code = await new Response(stream).text();
  const script = document.createElement("script");
  script.textContent = code;
  document.head.appendChild(script);
  const fig = JSON.parse(document.getElementById("figure-json").textContent);
  Plotly.newPlot("figure", fig.data, fig.layout || {}, {responsive: true});
})();"""


@functools.cache
def packed_plotly_js() -> str:
    """plotly.js of the installed plotly package, gzip-compressed (no timestamp: the same bytes
    every time) and base64 encoded."""
    from plotly.offline import get_plotlyjs  # deferred: plotly is slow to import

    return base64.b64encode(gzip.compress(get_plotlyjs().encode("utf-8"), compresslevel=9, mtime=0)).decode("ascii")


def figure_html(fig: Any, title: str = "") -> str:
    """``fig`` (a plotly figure) as a full HTML page that draws it: its JSON, the compressed
    plotly.js and the loader. ``</`` in the JSON is written ``<\\/`` so no text ends its script."""
    spec = fig.to_json().replace("</", "<\\/")
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title>"
            "<style>html,body{height:100%;margin:0}#figure{height:100%;width:100%}</style></head>\n"
            "<body><div id=\"figure\"></div>\n"
            f"<script id=\"figure-json\" type=\"application/json\">{spec}</script>\n"
            f"<script id=\"plotly-js-gzip\" type=\"application/octet-stream\">{packed_plotly_js()}</script>\n"
            f"<script>{_LOADER}</script>\n</body></html>\n")


def _script_text(page: str, script_id: str, script_type: str) -> str:
    """The text of the page's script element ``script_id`` (written by :func:`figure_html`)."""
    opening = f'<script id="{script_id}" type="{script_type}">'
    start = page.index(opening) + len(opening)
    return page[start:page.index("</script>", start)]


def plotly_js_of(page: str) -> bytes:
    """The plotly.js a page of :func:`figure_html` carries, inflated."""
    return gzip.decompress(base64.b64decode(_script_text(page, "plotly-js-gzip", "application/octet-stream")))


def figure_json(page: str) -> dict:
    """The figure a page of :func:`figure_html` draws (its JSON, parsed)."""
    return json.loads(_script_text(page, "figure-json", "application/json"))
