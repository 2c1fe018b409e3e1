"""The live status file of a file-mode run (``--status-file``), written by the last rank.

A heartbeat thread replaces the JSON file every ``interval`` seconds and once at the end. ``state`` is
``loading``, ``running``, ``finished``, ``stopped`` or ``failed: <reason>``; ``updated_at`` with
``heartbeat_seconds`` tells a dead writer from a live one (:func:`is_stale`). Read by ``launch/drain.sh``,
the Slurm/LSF recipes (:func:`describe`), ``--dry-run``'s estimate and ``--metrics-port``.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path

import orjson

from tasks.files import atomic_path

RATE_WINDOW_S = 60.0  # "tokens/s over the last minute"
STALE_BEATS = 3  # a reader calls the file stale after this many missed heartbeats


def peak_rss_bytes() -> int:
    """The most resident memory this process has held: Linux's VmHWM, which starts afresh at exec (Linux
    carries ``ru_maxrss`` across fork and exec: a large parent's peak would be reported); elsewhere
    ``ru_maxrss`` (bytes on macOS)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def peak_memory_mb(device=None) -> float:
    """This process's peak: allocated CUDA memory on a GPU stage, else the resident set."""
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        import torch

        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return round(peak_rss_bytes() / 2**20, 1)


class RunStatus:
    """The run's figures on the writing rank and the heartbeat that publishes them."""

    def __init__(self, path: str | os.PathLike, record: dict, files: list[tuple[str, str, int]],
                 interval: float = 5.0, pipeline_size: int = 1):
        self.path = Path(path)
        self.record, self.interval, self.pipeline_size = record, float(interval), pipeline_size
        self.lock = threading.Lock()
        self.state = "loading"
        self.started_at = time.time()
        self.files = [{"input": i, "output": o, "lines_total": n, "lines_done": 0, "lines_written": 0, "resumed_lines": 0,
                       "errors": 0, "state": "waiting"} for i, o, n in files]
        self.current: dict | None = None
        self.done_tokens: Counter = Counter()  # prompt, generated and cached tokens of the files already closed
        self.tokens: Counter = Counter()  # the open file's
        self.samples: deque[tuple[float, int, int]] = deque()  # (time, generated tokens, lines done) in the window
        self.file_started = time.time()
        self.stages: list[dict] = []
        self.last_pass_at: float | None = None
        self.running_since: float | None = None  # the first file's opening: loading is over
        self.ended_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- updates from the last rank (main thread) ------------------------------------------------------

    def start(self) -> None:
        """Write the first file and start the heartbeat."""
        self.write()
        self._thread = threading.Thread(target=self._beat, name="status", daemon=True)
        self._thread.start()

    def open_file(self, input_path: str, output: str, total: int, resumed: int) -> None:
        with self.lock:
            self.state = "running"
            self.running_since = self.running_since or time.time()
            entry = next((f for f in self.files if f["output"] == output), None)
            if entry is None:
                entry = {"input": input_path, "output": output}
                self.files.append(entry)
            entry.update(lines_total=total, lines_done=resumed, lines_written=resumed, resumed_lines=resumed, errors=0,
                         state="running")
            self.current, self.file_started = entry, time.time()
            self.tokens = Counter()
            self.stages = []

    def skip_file(self, output: str) -> None:
        """An input whose output was complete before the run."""
        with self.lock:
            for f in self.files:
                if f["output"] == output:
                    f.update(state="skipped", lines_done=f["lines_total"], lines_written=f["lines_total"])

    def progress(self, lines_done: int, errors: int, prompt: int, cached: int, generated: int,
                 stages: list[list[float]] | None = None, lines_written: int | None = None) -> None:
        """After a pass: the open file's lines answered, in any order (resumed ones included), of them
        ``lines_written`` in input order so far, and tokens; ``stages``: per stage [busy seconds since
        the file opened, KV cells held, peak memory MiB] when the pass carried them."""
        now = time.time()
        with self.lock:
            f = self.current
            if f is None:
                return
            f["lines_done"], f["errors"] = lines_done, errors
            f["lines_written"] = lines_done if lines_written is None else lines_written
            self.tokens = Counter(prompt=prompt, generated=generated, cached=cached)
            self.last_pass_at = now
            self.samples.append((now, (self.done_tokens + self.tokens)["generated"], self._lines_done()))
            while self.samples and now - self.samples[0][0] > RATE_WINDOW_S:
                self.samples.popleft()
            if stages:
                wall = max(now - self.file_started, 1e-9)
                self.stages = [{"stage": i, "busy_fraction": round(min(1.0, s[0] / wall), 4), "kv_cells": int(s[1]),
                                "peak_memory_mb": s[2]} for i, s in enumerate(stages)]

    def close_file(self, complete: bool) -> None:
        with self.lock:
            if self.current is not None:
                self.current["state"] = "finished" if complete else "incomplete"
            self.done_tokens.update(self.tokens)
            self.tokens = Counter()
            self.current = None

    def finish(self, state: str) -> None:
        """The last write: ``finished``, ``stopped`` or ``failed: reason``; the heartbeat stops."""
        with self.lock:
            if self.state.startswith("failed"):
                return  # the first reason stays
            self.state = state
            self.ended_at = time.time()
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 5)
        self.write()
        if self in _ACTIVE:  # ended: a later run's failure in this process is not this run's
            _ACTIVE.remove(self)

    # -- the file ------------------------------------------------------------------------------------

    def _lines_done(self) -> int:
        return sum(f["lines_done"] - f.get("resumed_lines", 0) for f in self.files if f["state"] != "skipped")

    def snapshot(self) -> dict:
        """The status as a dict (what the file holds)."""
        now = time.time()
        with self.lock:
            elapsed = now - self.started_at
            total = self.done_tokens + self.tokens
            generated, prompt, cached = total["generated"], total["prompt"], total["cached"]
            window = [s for s in self.samples if now - s[0] <= RATE_WINDOW_S]
            recent_tok = recent_lines = None
            if len(window) >= 2 and window[-1][0] > window[0][0]:
                span = window[-1][0] - window[0][0]
                recent_tok = (window[-1][1] - window[0][1]) / span
                recent_lines = (window[-1][2] - window[0][2]) / span
            remaining = sum(max(0, (f["lines_total"] or 0) - f["lines_done"]) for f in self.files
                            if f["state"] not in ("skipped", "finished"))
            done = self._lines_done()
            compute_s = max(now - self.file_started, 1e-9) if self.current else elapsed
            rate = recent_lines or (done / compute_s if done else None)
            eta = 0.0 if remaining == 0 and self.state == "finished" else (  # none once stopped or failed
                round(remaining / rate, 1) if rate and self.state == "running" else None)
            return {
                "state": self.state,
                "updated_at": round(now, 3),
                "heartbeat_seconds": self.interval,
                "started_at": round(self.started_at, 3),
                "elapsed_seconds": round(elapsed, 1),
                "last_pass_at": round(self.last_pass_at, 3) if self.last_pass_at else None,
                "compute_seconds": round((self.ended_at or now) - self.running_since, 1) if self.running_since else 0.0,
                "pid": os.getpid(),
                "run": self.record,
                "files": [dict(f) for f in self.files],
                "lines_total": sum(f["lines_total"] or 0 for f in self.files),
                "lines_done": sum(f["lines_done"] for f in self.files),
                "lines_written": sum(f.get("lines_written", f["lines_done"]) for f in self.files),
                "errors": sum(f["errors"] for f in self.files),
                "prompt_tokens": prompt,
                "generated_tokens": generated,
                "cached_prompt_tokens": cached,
                "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
                "generated_tokens_per_second_last_minute": round(recent_tok, 2) if recent_tok is not None else None,
                "generated_tokens_per_second": round(generated / elapsed, 2) if elapsed > 0 else None,
                "eta_seconds": eta,
                "pipeline_size": self.pipeline_size,
                "stages": [dict(s) for s in self.stages],
                "kv_cells_in_use": sum(s["kv_cells"] for s in self.stages),
            }

    def write(self) -> None:
        data = orjson.dumps(self.snapshot(), option=orjson.OPT_INDENT_2)
        try:
            with atomic_path(self.path, fsync=False) as tmp:
                tmp.write_bytes(data)
        except OSError as e:  # a full disk must not stop the run: the file goes stale, the log says why
            print(f"status file {self.path}: {e}", file=sys.stderr)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            self.write()


_ACTIVE: list[RunStatus] = []  # the running status files of this process (--in-process: each writing rank's)


def activate(status: RunStatus | None) -> None:
    """``status`` runs until it finishes: fail_active reaches it meanwhile."""
    if status is not None:
        _ACTIVE.append(status)


def fail_active(reason: str) -> None:
    """The run is ending on an error or a signal: say so in the status files still running in this
    process (a finished one keeps its state)."""
    for status in list(_ACTIVE):
        status.finish(f"failed: {reason}")


def read_status(path: str | os.PathLike) -> dict | None:
    """The status file's content, None when missing or not a status file (never torn: it is replaced whole)."""
    try:
        status = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return status if isinstance(status, dict) and "state" in status else None


def is_stale(status: dict, now: float | None = None) -> bool:
    """A ``loading`` or ``running`` status whose writer missed :data:`STALE_BEATS` heartbeats."""
    if status["state"] not in ("loading", "running"):
        return False
    now = time.time() if now is None else now
    return now - status["updated_at"] > STALE_BEATS * status["heartbeat_seconds"]


def describe(status: dict, now: float | None = None) -> str:
    """One line for logs and the drain loop."""
    state = status["state"]
    if is_stale(status, now):
        age = (time.time() if now is None else now) - status["updated_at"]
        state = f"stale ({state}, no update for {age:.0f}s: the writing rank is gone)"
    rate = status.get("generated_tokens_per_second_last_minute") or status.get("generated_tokens_per_second") or 0
    eta = status.get("eta_seconds")
    busy = " ".join(f"{s['busy_fraction']:.0%}" for s in status.get("stages", []))
    return (f"{state}: {status['lines_done']}/{status['lines_total']} lines, {status['errors']} errors, "
            f"{status['prompt_tokens']} prompt + {status['generated_tokens']} generated tokens, {rate:.1f} tok/s"
            + (f", ETA {eta:.0f}s" if eta is not None else "") + (f", stages busy {busy}" if busy else ""))


def main(argv: list[str] | None = None) -> int:
    """``python -m tasks.status FILE``: one line describing the run; exit 0 finished, 1 failed, stopped or
    stale (run it again to resume), 2 not a status file, 3 running."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tasks.status STATUS_FILE", file=sys.stderr)
        return 2
    status = read_status(argv[0])
    if status is None and os.path.exists(argv[0]):  # a watcher must not wait on it forever
        print(f"{argv[0]}: not a status file (docs/usage/monitoring.md)", file=sys.stderr)
        return 2
    if status is None:
        print(f"{argv[0]}: no status file (yet)")
        return 3
    print(describe(status))
    if status["state"] == "finished":
        return 0
    return 1 if status["state"].startswith(("failed", "stopped")) or is_stale(status) else 3


if __name__ == "__main__":
    sys.exit(main())
