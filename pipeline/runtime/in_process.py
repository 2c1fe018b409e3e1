"""``--in-process``: every rank of a run as a thread of this process, joined by in-memory links.

Each rank plans, starts and plays its role as under torchrun, with :mod:`comm.local` in place of the
process group; rank 0 runs on the calling thread, so its exit code and output are this process's. For
tests of several stages without processes (docs/testing.md), a debugger that sees every stage, and
several stages on one GPU. A rank that raises is marked dead, so the others stop at their next
receive; the first failure that is not a lost peer is raised here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable

from comm.dist import local_infos
from comm.p2p import PeerLost
from pipeline.config.options import UsageError

log = logging.getLogger("runner")

_LAYOUT_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RANK = threading.local()  # .value: the rank whose thread this is (log lines say it)


def rank_options(opts, rank: int, world: int):
    """Rank ``rank``'s own copy of the options (roles write into theirs, e.g. the resolved budget)."""
    return dataclasses.replace(opts, rank=rank, world_size=world, pipeline_group_size=world // opts.data_group_size,
                               dist_url=None, in_process=False)  # (a rank's own options: it is one rank)


def in_process_options(opts):
    """Rank 0's options of an ``--in-process`` run (UsageError when the process is one rank of a launch)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--in-process runs every rank in one process, but this process is one rank of a launch "
                         "(torchrun): drop --in-process, or start it with plain python")
    pipeline = opts.pipeline_group_size or 1
    return rank_options(dataclasses.replace(opts, pipeline_group_size=pipeline), 0, pipeline * opts.data_group_size)


def plan_env() -> dict[str, str]:
    """The environment a rank plans with: this process's, without a launcher's layout variables."""
    return {k: v for k, v in os.environ.items() if k not in _LAYOUT_ENV}


class LocalRanks:
    """Every rank of a run in this process: their plans and places (:meth:`start` runs ranks 1 ..
    W-1 on threads, rank 0 is the caller's), their exit codes and failures."""

    def __init__(self, opts, plan0, make_plan: Callable):
        """``plan0``: rank 0's plan (made by the caller, which reported its warnings)."""
        world = plan0.world
        self.infos = local_infos(plan0.pipeline, plan0.data)
        self.opts = [rank_options(opts, r, world) for r in range(world)]
        self.plans = [plan0] + [make_plan(self.opts[r], plan_env()) for r in range(1, world)]
        self.codes: list[int | None] = [None] * world
        self.errors: list[BaseException | None] = [None] * world
        self.threads: list[threading.Thread] = []

    def run(self, r: int, execute: Callable) -> None:
        """Rank ``r``'s ``execute(plan, opts, info) -> exit code`` on this thread; a failure is kept and
        the rank marked dead, so that its neighbours stop at their next receive."""
        RANK.value = r
        try:
            self.codes[r] = execute(self.plans[r], self.opts[r], self.infos[r])
        except BaseException as e:  # noqa: BLE001 - raised by raise_failure once all have ended
            self.errors[r] = e
            if self.infos[r].local is not None:
                self.infos[r].local.fail(r, f"{type(e).__name__}: {e}")
        finally:
            RANK.value = None

    def start(self, execute: Callable) -> None:
        """Ranks 1 .. W-1 on threads of their own."""
        self.threads = [threading.Thread(target=self.run, args=(r, execute), name=f"rank {r}", daemon=True)
                        for r in range(1, len(self.infos))]
        for t in self.threads:
            t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join()

    def raise_failure(self) -> None:
        """The first failure that is not a lost peer (the others follow from it), else the first."""
        failure = next((e for e in self.errors if e is not None and not isinstance(e, PeerLost)), None) or \
            next((e for e in self.errors if e is not None), None)
        if failure is not None:
            raise failure


def run_in_process(opts, plan0, execute: Callable, make_plan: Callable) -> int:
    """Run every rank, rank 0 on this thread; ``execute(plan, opts, info) -> exit code`` is a rank's
    start-up and role. Returns the largest exit code of the pipelines' first ranks; raises the first
    rank failure. The caller's torch thread count is given back (each rank sets its share of the cores
    for the process: a caller that goes on, a test, keeps its own)."""
    import torch

    threads = torch.get_num_threads()
    ranks = LocalRanks(opts, plan0, make_plan)
    ranks.start(execute)
    try:
        ranks.run(0, execute)
    finally:
        ranks.join()
        torch.set_num_threads(threads)
    ranks.raise_failure()
    return max(ranks.codes[r] or 0 for r, info in enumerate(ranks.infos) if info.is_first)


def rank_of_thread(default: int) -> int:
    """The rank this thread runs (``--in-process``), else ``default`` (the process's)."""
    value = getattr(RANK, "value", None)
    return default if value is None else value

