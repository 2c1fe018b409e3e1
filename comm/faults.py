"""Fault injection for the reliability tests: ``DIST_INFER_FAULT=point`` (and optionally
``DIST_INFER_FAULT_RANK=r``, default every rank) makes this process SIGKILL itself at a named
point, exactly like a crash or an OOM kill would. The points:

- ``load``: after this rank loaded its weights;
- ``prefill``: last rank, its first pass with a prefill, nothing written yet;
- ``midgen``: last rank, once 3 lines are journaled;
- ``drive``: rank 0, at its 10th reply;
- ``finalize``: the journal is complete and synced, not yet published;
- ``line``: last rank, whenever a pass admits input line ``DIST_INFER_FAULT_LINE`` (a request that
  kills the process each time it runs: tasks.inflight); ``line-raise``: raises there instead, as a
  stage's forward that fails on that request would.

Unset in normal runs, where each call costs one attribute test.
"""

from __future__ import annotations

import os
import signal


class FaultPoint:
    def __init__(self, name: str, after: int = 1):
        self.name, self.after, self.calls = name, after, 0
        self.armed = os.environ.get("DIST_INFER_FAULT") == name
        self.rank = os.environ.get("DIST_INFER_FAULT_RANK")

    def set_rank(self, rank: int) -> None:
        """Disarm on every rank but ``DIST_INFER_FAULT_RANK`` (when it is set)."""
        if self.rank is not None and int(self.rank) != rank:
            self.armed = False

    def tick(self, ready: bool = True) -> None:
        """Count one call (when ``ready``); kill this process at the ``after``-th."""
        if not self.armed or not ready:
            return
        self.calls += 1
        if self.calls >= self.after:
            os.kill(os.getpid(), signal.SIGKILL)


class LinePoint(FaultPoint):
    """Kills the process whenever line ``DIST_INFER_FAULT_LINE`` is admitted."""

    def __init__(self):
        super().__init__("line")
        self.raises = os.environ.get("DIST_INFER_FAULT") == "line-raise"
        self.armed |= self.raises
        self.line = int(os.environ.get("DIST_INFER_FAULT_LINE", "-1"))

    def admit(self, indices) -> None:
        if self.armed and self.line in indices:
            if self.raises:
                raise RuntimeError(f"injected fault: a forward failing on line {self.line}")
            os.kill(os.getpid(), signal.SIGKILL)


LOAD, PREFILL, MIDGEN = FaultPoint("load"), FaultPoint("prefill"), FaultPoint("midgen")
DRIVE, FINALIZE, LINE = FaultPoint("drive", after=10), FaultPoint("finalize"), LinePoint()
POINTS = (LOAD, PREFILL, MIDGEN, DRIVE, FINALIZE, LINE)


def set_rank(rank: int) -> None:
    """Tell every point which rank this process is (once, after the layout is known)."""
    for p in POINTS:
        p.set_rank(rank)
