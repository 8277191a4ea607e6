"""Headless Chromium driven through the DevTools protocol, for tests that look
at a page as a person would: open a URL, read the rendered DOM, take a screenshot.

Debian's ``chromium`` package (``apt-get install chromium``); nothing is
downloaded. The protocol goes over a websocket (``websocket-client``).

    with Chromium() as browser:
        browser.open("http://127.0.0.1:8001/dashboard")
        text = browser.text("#jobs")
        browser.screenshot(path)
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import httpx


def chromium_path() -> Optional[str]:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class BrowserError(RuntimeError):
    pass


class Chromium:
    def __init__(self, executable: Optional[str] = None, width: int = 1400, height: int = 1000,
                 start_timeout_s: float = 30.0) -> None:
        self.executable = executable or chromium_path()
        if not self.executable:
            raise BrowserError("chromium is not installed (apt-get install chromium)")
        self.size = (width, height)
        self.start_timeout_s = start_timeout_s
        self._profile: Optional[tempfile.TemporaryDirectory] = None
        self._proc: Optional[subprocess.Popen] = None
        self._ws = None
        self._ids = itertools.count(1)

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> "Chromium":
        import websocket

        self._profile = tempfile.TemporaryDirectory(prefix="ndif-chromium-")
        profile = Path(self._profile.name)
        self._log = open(profile / "chromium.log", "wb")
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        self._proc = subprocess.Popen(
            [
                self.executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-sync",
                "--disable-background-networking", "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile}",
                f"--window-size={self.size[0]},{self.size[1]}", "about:blank",
            ],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.start_timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise BrowserError(f"chromium did not start its DevTools endpoint:\n{self._tail()}")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10, trust_env=False).json()
        page = next(t for t in targets if t.get("type") == "page")
        self._ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Network.enable")
        return self

    def stop(self) -> None:
        if self._ws is not None:
            try:
                self._ws.close()
            except Exception:  # noqa: BLE001
                pass
            self._ws = None
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, 15)
                self._proc.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self._proc.pid, 9)
                except ProcessLookupError:
                    pass
                self._proc.wait(10)
        if self._profile is not None:
            self._log.close()
            self._profile.cleanup()
            self._profile = None

    def __enter__(self) -> "Chromium":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _tail(self) -> str:
        try:
            return (Path(self._profile.name) / "chromium.log").read_text(errors="replace")[-3000:]
        except (OSError, AttributeError):
            return "(no log)"

    # -- the protocol ----------------------------------------------------------------

    def call(self, method: str, **params) -> dict:
        message_id = next(self._ids)
        self._ws.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv())
            if message.get("id") == message_id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    # -- what a test does --------------------------------------------------------------

    def set_headers(self, headers: dict) -> None:
        """Send these headers with every request (e.g. HTTP Basic credentials)."""
        self.call("Network.setExtraHTTPHeaders", headers=headers)

    def open(self, url: str, timeout_s: float = 30.0) -> None:
        """Navigate and wait until the page has loaded."""
        navigated = self.call("Page.navigate", url=url)
        if navigated.get("errorText"):
            raise BrowserError(f"{url}: {navigated['errorText']}")
        self.wait_loaded(timeout_s)

    def wait_loaded(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.evaluate("document.readyState") == "complete":
                    return
            except BrowserError:
                pass  # the old document went away mid-call; ask the new one
            if time.monotonic() > deadline:
                raise BrowserError("the page did not finish loading")
            time.sleep(0.05)

    def text(self, selector: str = "body") -> str:
        """The rendered text (innerText) of the first element matching ``selector``."""
        value = self.evaluate(f"(e => e ? e.innerText : null)(document.querySelector({json.dumps(selector)}))")
        if value is None:
            raise BrowserError(f"nothing on the page matches {selector!r}")
        return value

    def rows(self, selector: str) -> list[list[str]]:
        """The cells' text of each row of the table ``selector`` (header row included)."""
        return self.evaluate(
            f"Array.from(document.querySelectorAll({json.dumps(selector + ' tr')}))"
            ".map(r => Array.from(r.cells).map(c => c.innerText.trim()))"
        )

    def fill(self, form: str, **fields: Any) -> None:
        """Type into the form ``form`` (a selector): text by ``name``, True/False for a checkbox."""
        for name, value in fields.items():
            found = self.evaluate(
                f"(f => {{ const e = f && f.elements[{json.dumps(name)}]; if (!e) return false;"
                f" if (e.type === 'checkbox') e.checked = {json.dumps(bool(value))};"
                f" else e.value = {json.dumps('' if value is None else str(value))}; return true; }})"
                f"(document.querySelector({json.dumps(form)}))")
            if not found:
                raise BrowserError(f"no field {name!r} in {form!r}")

    def submit(self, form: str, timeout_s: float = 30.0) -> None:
        """Press the submit button of ``form`` as a person would, and wait for the answer's page."""
        self.evaluate("window.__before_submit = true")
        clicked = self.evaluate(
            f"(f => {{ if (!f) return false; const b = f.querySelector('[type=submit]');"
            f" if (b) b.click(); else f.requestSubmit(); return true; }})(document.querySelector({json.dumps(form)}))")
        if not clicked:
            raise BrowserError(f"nothing on the page matches {form!r}")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.evaluate("window.__before_submit === undefined && document.readyState === 'complete'"):
                    return
            except BrowserError:
                pass  # between two documents
            if time.monotonic() > deadline:
                raise BrowserError(f"submitting {form!r}: no new page within {timeout_s:.0f} s")
            time.sleep(0.05)

    def status(self) -> Optional[int]:
        """The HTTP status of the page now shown (its navigation entry)."""
        return self.evaluate("(performance.getEntriesByType('navigation')[0] || {}).responseStatus")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
