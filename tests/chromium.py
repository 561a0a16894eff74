"""A real headless Chromium driven over its DevTools protocol, for the tests of kiln's web pages.

Debian's `chromium` package (scripts/system-deps.sh) and the `websockets` client are all it needs: no
driver binary to match, nothing downloaded at test time. Keys go through `Input.dispatchKeyEvent`, the
browser's own input path, so a page's keydown handler sees them as it would a person's.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from websockets.sync.client import connect

KEY_CODES = {"ArrowLeft": 37, "ArrowUp": 38, "ArrowRight": 39, "ArrowDown": 40, **{str(d): 48 + d for d in range(10)}}


def chromium_binary() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


class Browser:
    """One headless Chromium with one page; `close()` ends the process group it started."""

    def __init__(self, binary: str, profile: Path, start_timeout: float = 30.0):
        args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.ids = itertools.count(1)
        self.stack = ExitStack()  # the DevTools connection, closed by close()
        try:
            port = self._devtools_port(profile / "DevToolsActivePort", start_timeout)
            targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
            page = next(t for t in targets if t["type"] == "page")
            self.ws = self.stack.enter_context(connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10))
        except BaseException:
            self.close()
            raise

    def _devtools_port(self, path: Path, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode} before it listened")
            lines = path.read_text().splitlines() if path.exists() else []
            if lines and lines[0].isdigit():
                return int(lines[0])
            time.sleep(0.05)
        raise TimeoutError(f"chromium did not open its DevTools port within {timeout} s")

    def call(self, method: str, **params) -> dict:
        """One DevTools command; its result (events that arrive meanwhile are skipped)."""
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression!r} threw: {res['exceptionDetails']}")
        return res["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 10.0):
        """Poll a JavaScript expression until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError:  # the page is between two documents
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression!r} stayed falsy for {timeout} s")
            time.sleep(0.05)

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for(f"document.readyState === 'complete' && location.href === {json.dumps(url)}")

    def press(self, key: str) -> None:
        """A key press and release, as from a keyboard."""
        code = KEY_CODES[key]
        dom_code = key if key.startswith("Arrow") else f"Digit{key}"
        text = {} if key.startswith("Arrow") else {"text": key}
        self.call("Input.dispatchKeyEvent", type="keyDown", key=key, code=dom_code, windowsVirtualKeyCode=code, **text)
        self.call("Input.dispatchKeyEvent", type="keyUp", key=key, code=dom_code, windowsVirtualKeyCode=code)

    def close(self) -> None:
        self.stack.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group it started: chromium's zygote and renderers too
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
