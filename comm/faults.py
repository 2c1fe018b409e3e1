"""Fault injection for the reliability tests: ``DIST_INFER_FAULT=point`` (and optionally
``DIST_INFER_FAULT_RANK=r``, default every rank) makes this process SIGKILL itself at a named
point, exactly like a crash or an OOM kill would. Points: ``load`` (after loading weights),
``prefill`` (last rank, first prefill, nothing written yet), ``midgen`` (last rank, after 3 lines are
journaled), ``drive`` (rank 0, at its 10th reply), ``finalize`` (after the journal is complete and synced, before it is published).
Unset in normal runs; costs one dict lookup per call."""

from __future__ import annotations

import os
import signal

_POINT = os.environ.get("DIST_INFER_FAULT")
_RANK = os.environ.get("DIST_INFER_FAULT_RANK")


def maybe_fail(point: str, rank: int | None = None) -> None:
    if _POINT == point and (_RANK is None or rank is None or int(_RANK) == rank):
        os.kill(os.getpid(), signal.SIGKILL)
