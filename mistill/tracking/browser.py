"""The MLflow UI as a person sees it: a headless Chromium driven over the DevTools protocol.

Chromium runs with ``--remote-debugging-pipe``: JSON messages separated by NUL bytes on its file
descriptors 3 (commands to it) and 4 (its replies), standard library only. :class:`Chromium`
sends a method and waits for its reply; replies announcing attached targets (the UI shows an
HTML artifact in a sandboxed iframe, a separate target) are kept in ``attached``.
:class:`Page` is one tab: navigate, read its text, wait for something, take a screenshot. With
``auth``, every request of the tab carries HTTP basic-auth credentials (the project's server
refuses clients without them).

Used by the browser tests and by ``scripts/screenshots.py`` (the pictures in ``docs/``).
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

_TRAMPOLINE = ("import fcntl, os, sys\n"
               "a, b = (fcntl.fcntl(int(f), fcntl.F_DUPFD, 10) for f in sys.argv[1:3])\n"
               "os.dup2(a, 3)\nos.dup2(b, 4)\nos.execvp(sys.argv[3], sys.argv[3:])\n")


def chromium_binary() -> str:
    """The ``chromium`` on PATH; a clear error without one."""
    binary = shutil.which("chromium")
    if binary is None:
        raise FileNotFoundError("chromium is not on PATH (Debian: apt-get install chromium; "
                                "scripts/test.sh installs it for the test suite)")
    return binary


class Chromium:
    """A headless Chromium on a DevTools pipe: :meth:`call` a method, read attached targets."""

    def __init__(self, profile: Path, binary: str | None = None) -> None:
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()
        args = [binary or chromium_binary(), "--headless", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--no-first-run", "--remote-debugging-pipe",
                f"--user-data-dir={profile}", "about:blank"]
        # the protocol's fds in the child: 3 (commands to chromium) and 4 (its replies), set by a
        # Python trampoline (copies above 9 first, so that no dup2 overwrites the other pipe)
        self.proc = subprocess.Popen([sys.executable, "-c", _TRAMPOLINE, str(to_chrome_r), str(from_chrome_w), *args],
                                     pass_fds=(to_chrome_r, from_chrome_w), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._id = 0
        self.attached: list[dict[str, Any]] = []

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30) -> dict:
        """Send ``method`` (to ``session``'s target, or the browser) and return its result."""
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
        """The value of a JavaScript ``expression`` in ``session``'s page."""
        out = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session)
        return out["result"].get("value")

    def page(self, width: int = 1400, height: int = 1000, auth: tuple[str, str] | None = None,
             auto_attach: bool = False) -> Page:
        """A new tab of ``width`` x ``height`` CSS pixels; ``auth``: basic-auth credentials sent
        with each of its requests; ``auto_attach``: attach its iframes as targets too."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable", session=session)
        if auth is not None:
            token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
            self.call("Network.enable", session=session)
            self.call("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}},
                      session=session)
        if auto_attach:
            self.call("Target.setAutoAttach", {"autoAttach": True, "waitForDebuggerOnStart": False,
                                               "flatten": True}, session=session)
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False}, session=session)
        return Page(self, session)

    def close(self) -> None:
        """Close the browser (killed if it does not exit) and the pipe."""
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


class Page:
    """One tab of a :class:`Chromium`."""

    def __init__(self, browser: Chromium, session: str) -> None:
        self.browser = browser
        self.session = session

    def navigate(self, url: str) -> None:
        self.browser.call("Page.navigate", {"url": url}, session=self.session)

    def evaluate(self, expression: str) -> Any:
        return self.browser.evaluate(expression, self.session)

    def text(self) -> str:
        """The page's visible text (``document.body.innerText``; empty before the body exists)."""
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def wait_for_text(self, *needles: str, timeout: float = 60.0) -> str:
        """The page's text once it holds every one of ``needles``; raises TimeoutError otherwise."""
        text = until(lambda: (t := self.text()) and all(n in t for n in needles) and t, timeout)
        if not text:
            raise TimeoutError(f"the page never showed {needles!r} within {timeout} s")
        return text

    def screenshot(self, path: Path | None = None) -> bytes:
        """A PNG of the viewport (written to ``path`` when given)."""
        png = base64.b64decode(self.browser.call("Page.captureScreenshot", {"format": "png"},
                                                 session=self.session)["data"])
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(png)
        return png


def until(check: Callable[[], Any], timeout: float = 60.0, every: float = 0.5) -> Any:
    """Poll ``check()`` until it returns something truthy; that value, or the last one."""
    end = time.monotonic() + timeout
    value = check()
    while not value and time.monotonic() < end:
        time.sleep(every)
        value = check()
    return value
