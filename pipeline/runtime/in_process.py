"""``--in-process``: every rank of a run as a thread of this process, joined by in-memory links.

Each rank plans, loads its stage and plays its role exactly as it would as a process under torchrun
(the same start-up, rank loops and messages, :mod:`comm.local` in place of the process group); rank 0
runs on the calling thread, so its exit code and its output are this process's. What it is for:
contributors' tests of several stages without starting processes (docs/testing.md), a debugger that
sees every stage, and several stages on one GPU (NCCL refuses two processes on one device).

A rank that raises is marked dead in the :class:`comm.local.LocalWorld`, so the others stop at their
next receive (PeerLost); once every thread has ended, the first failure that is not a lost peer is
raised here, as the process's own error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable

from comm.dist import local_infos
from comm.p2p import PeerLost

log = logging.getLogger("runner")

_LAYOUT_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RANK = threading.local()  # .value: the rank whose thread this is (log lines say it)


def rank_options(opts, rank: int, world: int):
    """Rank ``rank``'s own copy of the options (roles write into theirs, e.g. the resolved budget)."""
    return dataclasses.replace(opts, rank=rank, world_size=world, pipeline_group_size=world // opts.data_group_size,
                               dist_url=None, in_process=False)  # (a rank's own options: it is one rank)


def plan_env() -> dict[str, str]:
    """The environment a rank plans with: this process's, without a launcher's layout variables."""
    return {k: v for k, v in os.environ.items() if k not in _LAYOUT_ENV}


def run_in_process(opts, plan0, execute: Callable, make_plan: Callable) -> int:
    """Run every rank; ``plan0`` is rank 0's plan (made by the caller, which reported its warnings),
    ``execute(plan, opts, info) -> exit code`` a rank's start-up and role. Returns the largest exit code
    of the pipelines' first ranks; raises the first rank failure."""
    world = plan0.world
    infos = local_infos(plan0.pipeline, plan0.data)
    ranks = [rank_options(opts, r, world) for r in range(world)]
    plans = [plan0] + [make_plan(ranks[r], plan_env()) for r in range(1, world)]
    codes: list[int | None] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def one(r: int) -> None:
        RANK.value = r
        try:
            codes[r] = execute(plans[r], ranks[r], infos[r])
        except BaseException as e:  # noqa: BLE001 - raised on the calling thread once all have ended
            errors[r] = e
            if infos[r].local is not None:
                infos[r].local.fail(r, f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(r,), name=f"rank {r}", daemon=True) for r in range(1, world)]
    for t in threads:
        t.start()
    try:
        one(0)
    finally:
        RANK.value = None
        for t in threads:
            t.join()
    failure = next((e for e in errors if e is not None and not isinstance(e, PeerLost)), None) or \
        next((e for e in errors if e is not None), None)
    if failure is not None:
        raise failure
    first = [codes[r] for r, info in enumerate(infos) if info.is_first]
    return max(c or 0 for c in first)


def rank_of_thread(default: int) -> int:
    """The rank this thread runs (``--in-process``), else ``default`` (the process's)."""
    value = getattr(RANK, "value", None)
    return default if value is None else value

