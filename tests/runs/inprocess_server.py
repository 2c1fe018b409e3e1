"""Serve mode in the test process (every rank a thread, stopped by its own event): what the tests of HTTP
faces start instead of a server process (--in-process)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.utils import free_port

try:  # the openai package's HTTP client (httpx, or its fork httpx2)
    import httpx
except ImportError:
    import httpx2 as httpx

FLAGS = ["--no-progress", "--num-threads", "1", "--budget", "4096"]


class Server:
    """Serve mode in this process (every rank a thread), stopped by its own event."""

    def __init__(self, tmp: Path, *flags: str, key: str = ""):
        import dist_inference_runner

        self.key = key
        self.port, self.stop = free_port(), threading.Event()
        argv = [*FLAGS, "--serve", f"127.0.0.1:{self.port}", "--serve-dir", str(tmp / "state"), "--in-process",
                *flags]
        self.thread = threading.Thread(target=dist_inference_runner.main, args=(argv,),
                                       kwargs={"signals": False, "stopping": self.stop}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url("/health"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError("the in-process server did not come up")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path: str, body: dict, key: str | None = None) -> httpx.Response:
        """POST ``body`` with the server's key (``key=""``: none)."""
        key = self.key if key is None else key
        return httpx.post(self.url(path), json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"} if key else {})

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive()
