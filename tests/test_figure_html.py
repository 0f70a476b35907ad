"""A figure's HTML page: plotly.js inside it, compressed, and the figure's JSON intact.

That the page draws in MLflow's artifact viewer (a sandboxed ``blob:`` iframe) is checked in
headless Chromium by ``tests/test_browser.py``."""

from __future__ import annotations

import re

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from mistill.tracking.figure_html import figure_html, figure_json, plotly_js_of


def _figure() -> go.Figure:
    fig = go.Figure(go.Scatter(x=[1, 2, 3], y=[0.5, -1.25, 2.0], name="own </script><b>x</b>"))
    fig.update_layout(title="Recovery & </script> at k")
    return fig


def test_the_page_carries_plotly_js_compressed_and_the_figure_intact():
    fig = _figure()
    page = figure_html(fig, title="a <title>")
    assert plotly_js_of(page) == get_plotlyjs().encode("utf-8")
    assert len(page) < 0.5 * len(get_plotlyjs())  # gzip + base64: well under half of plotly.js
    assert figure_json(page)["layout"]["title"]["text"] == "Recovery & </script> at k"
    assert figure_json(page)["data"][0]["name"] == "own </script><b>x</b>"
    assert figure_json(page)["data"][0]["y"] == [0.5, -1.25, 2.0]
    # no text of the figure ends a script early: every script element is one of the page's three
    assert len(re.findall(r"<script\b", page)) == 3 == len(re.findall(r"</script>", page))
    assert "<title>a &lt;title&gt;</title>" in page
    assert not re.search(r"<script[^>]+src=", page)  # nothing fetched: it draws offline


def test_the_same_figure_gives_the_same_bytes():
    assert figure_html(_figure()) == figure_html(_figure())
