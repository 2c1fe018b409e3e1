"""Fault injection for the reliability tests (docs/usage/recovery.md, "Testing faults"):
``DIST_INFER_FAULT=point`` (``DIST_INFER_FAULT_RANK=r``: on that rank only) makes this process SIGKILL
itself at a named point, as a crash or an OOM kill would:

- ``load``: after this rank loaded its weights;
- ``prefill``: last rank, its first pass with a prefill, nothing written yet;
- ``midgen``: last rank, once 3 lines are journaled;
- ``drive``: rank 0, at its 10th reply;
- ``finalize``: the journal is complete and synced, not yet published;
- ``line``: last rank, whenever a pass admits input line ``DIST_INFER_FAULT_LINE``;
- ``forward-raise`` / ``forward-kill``: a stage's forward raises (or SIGKILLs its process) whenever it
  computes a row of line ``DIST_INFER_FAULT_LINE``, from the ``DIST_INFER_FAULT_PASS``-th such pass on
  (default 1); each stage holds its own point, so that stages in one process each know their rank.

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
        self.line = int(os.environ.get("DIST_INFER_FAULT_LINE", "-1"))  # the line of ``line`` and ``forward-*``

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

    def admit(self, indices) -> None:
        if self.line in indices:  # (armed: its caller tests that)
            os.kill(os.getpid(), signal.SIGKILL)


class ForwardPoint(FaultPoint):
    """A stage's forward fails (raises, or kills the process) on line ``DIST_INFER_FAULT_LINE``'s rows.
    The stage learns which rows hold that line from the admissions passing through it."""

    def __init__(self):
        super().__init__("forward-raise")
        self.kills = os.environ.get("DIST_INFER_FAULT") == "forward-kill"
        self.armed |= self.kills
        self.rows: set[tuple[int, int]] = set()  # (slot, row) holding the line
        self.from_pass = int(os.environ.get("DIST_INFER_FAULT_PASS", "1"))
        self.passes = 0  # passes of this stage that computed the line's rows

    def watch(self, hdr) -> None:
        """Every pass (a PassHeader) through the stage: note which rows its admissions take (called only
        when armed: the stage tests it, as for :meth:`check`)."""
        for meta in hdr.admit:
            for r in meta.rows:
                (self.rows.add if meta.req == self.line and not meta.live else self.rows.discard)((hdr.slot, r))

    def check(self, hdr) -> None:
        """Before a stage computes ``hdr``: fail when it computes the line's rows."""
        rows = {*hdr.decode_rows, *(p.row for p in hdr.prefill)}
        if any((hdr.slot, r) in self.rows for r in rows):
            self.passes += 1
            if self.passes < self.from_pass:
                return
            if self.kills:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected fault: a forward failing on line {self.line}")


LOAD, PREFILL, MIDGEN = FaultPoint("load"), FaultPoint("prefill"), FaultPoint("midgen")
DRIVE, FINALIZE, LINE = FaultPoint("drive", after=10), FaultPoint("finalize"), LinePoint()
POINTS = (LOAD, PREFILL, MIDGEN, DRIVE, FINALIZE, LINE)  # a stage's ForwardPoint is its own (Stage.fault)


def set_rank(rank: int) -> None:
    """Tell every point which rank this process is (once, after the layout is known)."""
    for p in POINTS:
        p.set_rank(rank)
