"""Headless Chromium (Debian's ``chromium``) driven over the Chrome DevTools protocol, for tests of the
chat page: open a URL, evaluate JavaScript, wait for a condition, take a screenshot."""

from __future__ import annotations

import base64
import os
import signal
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"),
                             shutil.which("google-chrome")) if p), None)


class Browser:
    def __init__(self, port: int):
        import websocket  # websocket-client (requirements-test.txt)

        self.profile = tempfile.mkdtemp(prefix="chat-page-browser-")
        self.proc = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
                                      "--no-first-run", "--disable-extensions", "--window-size=1200,760",
                                      f"--remote-debugging-port={port}", f"--user-data-dir={self.profile}",
                                      "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                pages = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=2).read())
                target = next(p for p in pages if p.get("type") == "page")
                break
            except (OSError, StopIteration, ValueError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError("chromium did not start its DevTools endpoint")
                time.sleep(0.3)
        self.ws = websocket.create_connection(target["webSocketDebuggerUrl"], timeout=60)
        self.ids = itertools.count(1)

    def call(self, method: str, **params) -> dict:
        mid = next(self.ids)
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def open(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        self.wait("document.readyState === 'complete' && !!document.getElementById('model')")

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression: str, seconds: float = 120):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {expression}; page text: {self.js('document.body.innerText')}")

    def screenshot(self, path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)
