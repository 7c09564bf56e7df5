"""A page opened in a real headless Chromium (the distribution's package, which ``tests/engines.py install`` puts
there), driven over the Chrome DevTools Protocol with a small client: what it requested, what it logged as an
error, values read from its DOM, and a screenshot.

    with Browser.start() as browser:
        page = browser.open(Path("report.html"))
        page.requests, page.errors, page.evaluate("document.title"), page.screenshot(Path("shot.png"))

The README's picture of a report: ``python tests/browser.py EXPORT/report.html docs/report.png``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from websockets.sync.client import ClientConnection, connect

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium_path() -> Optional[str]:
    """The Chromium binary on PATH (or ``$FXL_CHROMIUM``), or None."""
    given = os.environ.get("FXL_CHROMIUM")
    if given:
        return given
    return next((found for found in map(shutil.which, CHROMIUM_NAMES) if found), None)


@dataclass
class Page:
    """One page loaded: every request it made (URLs), every error it logged (console, exceptions, the browser's own
    log: a Content-Security-Policy violation lands there)."""

    browser: "Browser"
    session: str
    requests: List[str] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)

    def evaluate(self, expression: str) -> Any:
        result = self.browser.call("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                                   self.session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path, width: int = 1200) -> Path:
        """The whole page as a PNG, ``width`` pixels wide."""
        height = 200  # a short viewport first: the page's own height at this width is then its scroll height
        for _ in range(2):
            self.browser.call("Emulation.setDeviceMetricsOverride",
                              {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
                              self.session)
            height = int(self.evaluate("document.documentElement.scrollHeight"))
        data = self.browser.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
                                 self.session)["data"]
        path.write_bytes(base64.b64decode(data))
        return path


class Browser:
    """A headless Chromium with its DevTools endpoint, spoken to over one websocket (flat sessions)."""

    def __init__(self, proc: subprocess.Popen, url: str, profile: str, timeout: float) -> None:
        self.proc, self.profile = proc, profile
        self._stack = contextlib.ExitStack()
        self.socket: ClientConnection = self._stack.enter_context(connect(url, max_size=None, open_timeout=timeout))
        self._next = 0
        self.events: List[Dict[str, Any]] = []

    @classmethod
    def start(cls, binary: Optional[str] = None, timeout: float = 60.0) -> "Browser":
        binary = binary or chromium_path()
        if binary is None:
            raise FileNotFoundError("no Chromium on PATH (apt-get install chromium; tests/engines.py install does)")
        profile = tempfile.mkdtemp(prefix="fxl-chromium-")
        proc = subprocess.Popen([binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                 "--disable-extensions", "--disable-background-networking", "--disable-sync",
                                 "--disable-component-update", "--disable-default-apps", "--remote-debugging-port=0",
                                 f"--user-data-dir={profile}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        deadline = time.monotonic() + timeout
        url = None
        seen: List[str] = []
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            seen.append(line)
            found = re.search(r"DevTools listening on (ws://\S+)", line)
            url = found.group(1) if found else None
        if url is None:
            proc.kill()
            raise RuntimeError("Chromium did not open its DevTools endpoint: " + "".join(seen[-20:]))
        return cls(proc, url, profile, timeout)

    def call(self, method: str, params: Optional[Dict[str, Any]] = None, session: Optional[str] = None,
             timeout: float = 60.0) -> Dict[str, Any]:
        """Send one command and wait for its answer (the events meanwhile are kept in ``events``)."""
        self._next += 1
        message: Dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        self.socket.send(json.dumps(message))
        deadline = time.monotonic() + timeout
        while True:
            reply = json.loads(self.socket.recv(timeout=max(deadline - time.monotonic(), 0.01)))
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, session: str, timeout: float = 60.0) -> Dict[str, Any]:
        """The first event ``method`` of ``session`` (already received, or the next to come)."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if event.get("method") == method and event.get("sessionId") == session:
                    return event
            self.events.append(json.loads(self.socket.recv(timeout=max(deadline - time.monotonic(), 0.01))))

    def open(self, path: Path, settle: int = 3) -> Page:
        """Load ``path`` in a new tab, with requests and errors recorded from before the first byte."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Network", "Runtime", "Log"):
            self.call(f"{domain}.enable", {}, session)
        self.events.clear()
        self.call("Page.navigate", {"url": path.resolve().as_uri()}, session)
        self.wait_for("Page.loadEventFired", session)
        for _ in range(settle):  # a late request (a font, an image) would be sent by now; ask the page to be sure
            self.call("Runtime.evaluate", {"expression": "document.readyState"}, session)
        page = Page(self, session)
        for event in (e for e in self.events if e.get("sessionId") == session):
            params = event.get("params", {})
            if event["method"] == "Network.requestWillBeSent":
                page.requests.append(params["request"]["url"])
            elif event["method"] == "Runtime.exceptionThrown":
                page.errors.append(json.dumps(params.get("exceptionDetails", {}))[:500])
            elif event["method"] == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                page.errors.append(json.dumps(params.get("args", []))[:500])
            elif event["method"] == "Log.entryAdded" and params["entry"].get("level") == "error":
                page.errors.append(params["entry"].get("text", ""))
        return page

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            self.proc.kill()
            self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def pages(*paths: Path) -> Iterator[Page]:
    """Each path opened in one browser (started and closed here)."""
    with Browser.start() as browser:
        for path in paths:
            yield browser.open(path)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python tests/browser.py PAGE.html SHOT.png")
    with Browser.start() as started:
        opened = started.open(Path(sys.argv[1]))
        if opened.errors or opened.requests != [Path(sys.argv[1]).resolve().as_uri()]:
            sys.exit(f"the page failed: errors {opened.errors}, requests {opened.requests}")
        print(opened.screenshot(Path(sys.argv[2])))
