"""--profiling: a per-rank Chrome trace (chrome://tracing, Perfetto) of compute and communication."""

from __future__ import annotations

import json
import time

from tasks.files import write_atomic


class Trace:
    def __init__(self, rank: int):
        self.rank = rank
        self.events: list[dict] = []
        # timestamps on the wall clock (microseconds since the epoch), measured with perf_counter: the
        # ranks' traces line up when loaded together (across nodes, as far as their clocks agree)
        self.origin = time.perf_counter() - time.time()

    def add(self, name: str, t0: float, t1: float, tid: int = 0, args: dict | None = None) -> None:
        """One complete event; tid 0 = compute, 1 = communication."""
        self.events.append({"name": name, "ph": "X", "pid": self.rank, "tid": tid,
                            "ts": round((t0 - self.origin) * 1e6, 1), "dur": round((t1 - t0) * 1e6, 1),
                            **({"args": args} if args else {})})

    def save(self, path: str) -> str:
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": "compute"}},
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 1, "args": {"name": "communication"}}]
        write_atomic(path, json.dumps({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}))
        return path
