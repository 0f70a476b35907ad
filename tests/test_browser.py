"""The report as a person sees it: headless Chromium opens the MLflow UI of the test server,
finds the report run, opens one of its figures in the artifact viewer and finds the plot drawn.

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON
messages separated by NUL bytes on file descriptors 3 and 4), standard library only. The UI
shows an HTML artifact in a sandboxed iframe, a separate target that auto-attach hands over.
Chromium missing is a failure, not a skip: ``scripts/test.sh`` installs Debian's ``chromium``.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from analysis_fixtures import build_run_set
from mlflow.tracking import MlflowClient
from stage_fixtures import unique

from mistill.stages.report import ReportConfig, run_report

pytestmark = pytest.mark.browser

FIGURE = "figures/recovery_vs_k_global.html"
_TRAMPOLINE = ("import fcntl, os, sys\n"
               "a, b = (fcntl.fcntl(int(f), fcntl.F_DUPFD, 10) for f in sys.argv[1:3])\n"
               "os.dup2(a, 3)\nos.dup2(b, 4)\nos.execvp(sys.argv[3], sys.argv[3:])\n")


class Chromium:
    """A headless Chromium on a DevTools pipe: :meth:`call` a method, read attached targets."""

    def __init__(self, profile: Path, binary: str) -> None:
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()

        args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--remote-debugging-pipe", f"--user-data-dir={profile}",
                "about:blank"]
        # the protocol's fds in the child: 3 (commands to chromium) and 4 (its replies), set by
        # a Python trampoline (copies above 9 first, so that no dup2 overwrites the other pipe)
        self.proc = subprocess.Popen([sys.executable, "-c", _TRAMPOLINE, str(to_chrome_r),
                                      str(from_chrome_w), *args],
                                     pass_fds=(to_chrome_r, from_chrome_w),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._id = 0
        self.attached: list[dict[str, Any]] = []

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30) -> dict:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("method") == "Target.attachedToTarget":
                    self.attached.append(reply["params"])
                if reply.get("id") == self._id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply["result"]
            ready, _, _ = select.select([self._r], [], [], 0.5)
            if ready:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self._buf += chunk
        raise TimeoutError(f"no reply to {method} within {timeout} s")

    def evaluate(self, expression: str, session: str) -> Any:
        out = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                        session=session)
        return out["result"].get("value")

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        os.close(self._w)
        os.close(self._r)


def _until(check, timeout: float = 60.0, every: float = 0.5) -> Any:
    """Poll ``check()`` until it returns something truthy; that value, or the last one."""
    end = time.monotonic() + timeout
    value = check()
    while not value and time.monotonic() < end:
        time.sleep(every)
        value = check()
    return value


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
    target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    page = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})[
        "sessionId"]
    browser.call("Page.enable", session=page)
    browser.call("Target.setAutoAttach", {"autoAttach": True, "waitForDebuggerOnStart": False,
                                          "flatten": True}, session=page)
    browser.call("Emulation.setDeviceMetricsOverride", {"width": 1400, "height": 1000,
                                                        "deviceScaleFactor": 1,
                                                        "mobile": False}, session=page)

    # the run page: its name, its metrics and its report tags, rendered by the UI's JavaScript
    browser.call("Page.navigate", {"url": f"{tracking_uri}/#/experiments/{exp_id}/runs/{run_id}"},
                 session=page)
    text = _until(lambda: (t := browser.evaluate("document.body.innerText", page))
                  and run_name in t and "n_tables" in t and t)
    assert text and run_name in text and "n_tables" in text and "mistill.stage" in text

    # the artifact viewer with one figure selected: the tree lists the report's artifacts
    browser.call("Page.navigate", {"url": f"{tracking_uri}/#/experiments/{exp_id}/runs/{run_id}"
                                          f"/artifacts/{FIGURE}"}, session=page)
    tree = _until(lambda: (t := browser.evaluate("document.body.innerText", page))
                  and "report.md" in t and t)
    assert "figures" in tree and "tables" in tree and "report.md" in tree
    assert _until(lambda: browser.evaluate(
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

    plot = _until(drawn)
    assert plot, "the figure's iframe never drew a plotly trace"
    assert plot["svg"] >= 1 and plot["traces"] == 8  # 2 phases x 4 sets
    assert set(plot["legend"]) == {"global", "random", "bottom", "own"}
    assert plot["panels"] == ["P1", "P2C"]
    assert "Knock-in recovery of the global sets" in plot["title"]

    shot = browser.call("Page.captureScreenshot", {"format": "png"}, session=page)
    png = base64.b64decode(shot["data"])
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    out = Path(os.environ.get("MISTILL_SCREENSHOT_DIR", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    (out / "report_figure.png").write_bytes(png)


def test_the_printed_experiment_link_opens_the_runs_table(tracking_uri, report_run, browser):
    """The link the demo and the pipeline print (``experiment_url``) opens the experiment's runs
    table, with the report run listed, not the GenAI traces overview."""
    from mistill.tracking.runs import experiment_url, run_url

    exp_id, run_id, run_name = report_run
    assert run_url(tracking_uri, exp_id, run_id).endswith("?workflowType=machine_learning")
    target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    page = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    browser.call("Page.enable", session=page)
    browser.call("Emulation.setDeviceMetricsOverride", {"width": 1400, "height": 1000, "deviceScaleFactor": 1,
                                                        "mobile": False}, session=page)
    browser.call("Page.navigate", {"url": experiment_url(tracking_uri, exp_id)}, session=page)
    text = _until(lambda: (t := browser.evaluate("document.body.innerText", page)) and run_name in t and t)
    assert text and run_name in text, "the runs table does not list the report run"
