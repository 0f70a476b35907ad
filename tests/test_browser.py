"""The report as a person sees it: headless Chromium opens the MLflow UI of the test server,
finds the report run, opens one of its figures in the artifact viewer and finds the plot drawn.

Chromium is driven over the DevTools protocol (:mod:`mistill.tracking.browser`), with the
owner's credentials on every request. The UI shows an HTML artifact in a sandboxed iframe, a
separate target that auto-attach hands over.
Chromium missing is a failure, not a skip: ``scripts/test.sh`` installs Debian's ``chromium``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from analysis_fixtures import build_run_set
from mlflow.tracking import MlflowClient
from stage_fixtures import unique

from mistill.stages.report import ReportConfig, run_report
from mistill.tracking.browser import Chromium, until
from mistill.tracking.experiments import experiment_url, run_url

pytestmark = pytest.mark.browser

FIGURE = "figures/recovery_vs_k_global.html"


def _auth() -> tuple[str, str] | None:
    """The owner's credentials the project's server asks every client for (set by its start)."""
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    return (user, password) if user and password else None


@pytest.fixture(scope="module")
def report_run(tracking_uri, tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    saved = os.environ.get("MISTILL_ROOT")
    os.environ["MISTILL_ROOT"] = str(root / "reader")
    try:
        corpus = unique("browser")
        build_run_set(tracking_uri, corpus, root / "writers", kinds=("knockin", "select_lambda"))
        run_id = run_report(ReportConfig(corpus=corpus, bootstrap=20, corpus_bootstrap=20))
    finally:
        if saved is None:
            os.environ.pop("MISTILL_ROOT", None)
        else:
            os.environ["MISTILL_ROOT"] = saved
    run = MlflowClient().get_run(run_id)
    return run.info.experiment_id, run_id, run.info.run_name


@pytest.fixture
def browser(tmp_path):
    binary = shutil.which("chromium")
    if binary is None:
        pytest.fail("chromium is not on PATH: scripts/test.sh installs Debian's chromium "
                    "(apt-get install chromium)")
    chrome = Chromium(tmp_path / "profile", binary)
    try:
        yield chrome
    finally:
        chrome.close()


def test_mlflow_ui_shows_the_report_run_and_its_figure(tracking_uri, report_run, browser,
                                                       tmp_path):
    exp_id, run_id, run_name = report_run
    tab = browser.page(1400, 1000, auth=_auth(), auto_attach=True)
    page = tab.session

    # the run page: its name, its metrics and its report tags, rendered by the UI's JavaScript
    browser.call("Page.navigate", {"url": f"{tracking_uri}/#/experiments/{exp_id}/runs/{run_id}"},
                 session=page)
    text = until(lambda: (t := browser.evaluate("document.body.innerText", page))
                  and run_name in t and "n_tables" in t and t)
    assert text and run_name in text and "n_tables" in text and "mistill.stage" in text

    # the artifact viewer with one figure selected: the tree lists the report's artifacts
    browser.call("Page.navigate", {"url": f"{tracking_uri}/#/experiments/{exp_id}/runs/{run_id}"
                                          f"/artifacts/{FIGURE}"}, session=page)
    tree = until(lambda: (t := browser.evaluate("document.body.innerText", page))
                  and "report.md" in t and t)
    assert "figures" in tree and "tables" in tree and "report.md" in tree
    assert until(lambda: browser.evaluate(
        "document.querySelectorAll('iframe.mlflow-html-iframe').length", page))

    # inside the iframe: plotly has drawn the figure (SVG, one panel per phase, every set)
    def drawn() -> dict | None:
        browser.call("Runtime.evaluate", {"expression": "1"}, session=page)  # read events
        for frame in reversed(browser.attached):
            if frame["targetInfo"]["type"] != "iframe":
                continue
            try:
                got = browser.evaluate(
                    "JSON.stringify({svg: document.querySelectorAll('svg.main-svg').length,"
                    " traces: document.querySelectorAll('g.trace.scatter').length,"
                    " legend: [...document.querySelectorAll('.legendtext')]"
                    ".map(e => e.textContent),"
                    " panels: [...document.querySelectorAll('.annotation-text')]"
                    ".map(e => e.textContent),"
                    " title: (document.querySelector('.gtitle') || {}).textContent})",
                    frame["sessionId"])
            except RuntimeError:  # a detached frame of an earlier page
                continue
            found = json.loads(got) if got else None
            if found and found["traces"]:
                return found
        return None

    plot = until(drawn)
    assert plot, "the figure's iframe never drew a plotly trace"
    assert plot["svg"] >= 1 and plot["traces"] == 8  # 2 phases x 4 sets
    assert set(plot["legend"]) == {"global", "random", "bottom", "own"}
    assert plot["panels"] == ["P1", "P2C"]
    assert "Knock-in recovery of the global sets" in plot["title"]

    out = Path(os.environ.get("MISTILL_SCREENSHOT_DIR", tmp_path))
    png = tab.screenshot(out / "report_figure.png")
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_the_printed_experiment_link_opens_the_runs_table(tracking_uri, report_run, browser):
    """The link the demo and the pipeline print (``experiment_url``) opens the experiment's runs
    table, with the report run listed, not the GenAI traces overview."""
    exp_id, run_id, run_name = report_run
    assert run_url(tracking_uri, exp_id, run_id).endswith("?workflowType=machine_learning")
    page = browser.page(1400, 1000, auth=_auth()).session
    browser.call("Page.navigate", {"url": experiment_url(tracking_uri, exp_id)}, session=page)
    text = until(lambda: (t := browser.evaluate("document.body.innerText", page)) and run_name in t and t)
    assert text and run_name in text, "the runs table does not list the report run"
