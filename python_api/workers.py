"""The other stages of an ``LLM(pipeline_size=P)``: P - 1 processes of the runner with the caller's flags
and the seed's per-rank ones (``--rank i --world-size P --dist-url tcp://127.0.0.1:PORT``), so each plans,
loads its stage and serves passes exactly as a rank under torchrun. ``DIST_INFER_LAUNCHER_PID`` ties it to
the caller (comm.lifeline); the end of its log is the message of a worker that dies.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from comm.lifeline import LAUNCHER_ENV

TAIL_LINES = 12  # of a dead worker's log, in the error the caller raises


def runner_path() -> str:
    """dist_inference_runner.py: beside this checkout's packages, or where pip installed it."""
    spec = importlib.util.find_spec("dist_inference_runner")
    if spec is not None and spec.origin:
        return spec.origin
    return str(Path(__file__).resolve().parents[2] / "dist_inference_runner.py")


class Workers:
    """Ranks 1 .. P-1 as subprocesses; :meth:`problem` says when one died, :meth:`stop` ends them all."""

    def __init__(self, argv: list[str], pipeline_size: int, dist_url: str, env: dict | None = None):
        self.logs = tempfile.TemporaryDirectory(prefix="dist-infer-workers-")
        base = {**os.environ, **(env or {}), LAUNCHER_ENV: str(os.getpid())}
        base.setdefault("PYTHONUNBUFFERED", "1")
        runner = runner_path()
        self.procs: list[subprocess.Popen] = []
        self.paths: list[Path] = []
        for rank in range(1, pipeline_size):
            path = Path(self.logs.name) / f"rank{rank}.log"
            cmd = [sys.executable, runner, *argv, "--rank", str(rank), "--world-size", str(pipeline_size),
                   "--pipeline-group-size", str(pipeline_size), "--dist-url", dist_url]
            with open(path, "wb") as log:
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                   env=base, start_new_session=True))
            self.paths.append(path)

    def problem(self) -> str | None:
        """The first dead worker's exit and the end of its log, else None."""
        for rank, (p, path) in enumerate(zip(self.procs, self.paths, strict=True), start=1):
            code = p.poll()
            if code is not None and code != 0:
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                return f"pipeline worker rank {rank} died ({how}); its log ends:\n{self.tail(path)}"
        return None

    @staticmethod
    def tail(path: Path) -> str:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-TAIL_LINES:]) or "(empty log)"

    def wait(self, timeout: float) -> bool:
        """True when every worker exited within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(self, grace: float = 10.0) -> None:
        """Wait ``grace`` seconds for clean exits, then SIGTERM, then SIGKILL; remove the logs."""
        for wait, sig in ((grace, signal.SIGTERM), (5.0, signal.SIGKILL), (5.0, None)):
            if self.wait(wait) or sig is None:
                break
            for p in self.procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):  # its group is gone already
                        os.killpg(p.pid, sig)
        self.logs.cleanup()
