"""The scheduler's two policies, where a request file and the HTTP server differ: :class:`FilePolicy`
(all of the file known ahead) and :class:`ServePolicy` (requests arrive one by one). The scheduler's
sizes are a :class:`~pipeline.config.components.SchedulerConfig` (:mod:`pipeline.config.pass_sizes`)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from pipeline.config.components import SchedulerConfig
from pipeline.scheduling.batches import Group, Slot

if TYPE_CHECKING:  # the scheduler calls its policy with itself
    from pipeline.scheduling.scheduler import Scheduler

class FilePolicy:
    """A request file: the queue is the rest of the file once it is shorter than the look-ahead."""

    serve = False

    def submitted(self, g: Group) -> None:
        """A group was queued (the file policy keeps no history)."""

    def even_tail(self, sched: Scheduler) -> bool:
        """Several micro-batches share the file's rest evenly (rows, scoring work)."""
        return len(sched.slots) > 1

    splits_tail = True  # at a file's end a slot's decode rows split over passes for every stage (Scheduler.parts)

    def new_slot(self, sched: Scheduler, rows: int, cols: int) -> tuple[int, int]:
        """A new micro-batch's (rows, cols): exactly what its groups need."""
        return rows, cols

    def pool_want(self, sched: Scheduler, want: int) -> int | None:
        """Cells the prefix pool gives way to (None: it stays): the oldest group's, once no slot is allocated."""
        return None if any(s.rows for s in sched.slots) else want

    def blocked_limit(self, sched: Scheduler, slot: Slot) -> int | None:
        """The oldest queued group fits no slot: every slot drains for it (nothing joins)."""
        return 0

    def unblocked(self) -> None:
        """The oldest queued group can start (the file policy keeps no state for it)."""


class ServePolicy:
    """HTTP traffic: a new micro-batch gets free rows sized for recent requests (the largest need of the
    last ``recent`` ones) within its share of the budget; a request longer than every micro-batch drains
    only the one with the fewest rows in use while the others keep taking requests."""

    serve = True

    def __init__(self, recent: int = 64):
        self.recent: deque[int] = deque(maxlen=recent)  # the needs of recent groups
        self.draining: int | None = None  # the slot left to drain for a blocked head

    def submitted(self, g: Group) -> None:
        self.recent.append(g.need)

    def even_tail(self, sched: Scheduler) -> bool:
        return False  # the queue is never "the rest": more requests come

    splits_tail = False

    def new_slot(self, sched: Scheduler, rows: int, cols: int) -> tuple[int, int]:
        """Free rows with room for recent requests, within this slot's share."""
        spare, cap = sched.spare, min(sched.budget - sched.used, max(sched.slot_share, rows * cols))
        typical = max(self.recent, default=0)
        cols = max(cols, min(typical + spare, cap // max(rows, 1)), cap // sched.max_rows)
        return max(rows, min(sched.max_rows, cap // cols)), cols

    def pool_want(self, sched: Scheduler, want: int) -> int | None:
        """A new micro-batch's share too: slots rarely all drain here, and a pool grown while traffic was
        light would keep every new slot small."""
        return max(want, sched.slot_share)

    def blocked_limit(self, sched: Scheduler, slot: Slot) -> int | None:
        """Only the slot with the fewest rows in use drains, taking groups that end before its longest
        row (backfill); the others take requests as usual (None)."""
        if self.draining is None or not sched.slots[self.draining].rows:
            self.draining = min((s for s in sched.slots if s.rows), key=lambda s: (s.live_rows, s.sid)).sid
        if slot.sid != self.draining:
            return None
        left = [sched.groups[g].need - n for g, n in zip(slot.row_group, slot.row_len) if g in sched.groups]
        return max(left, default=1) - 1

    def unblocked(self) -> None:
        self.draining = None


def policy_for(config: SchedulerConfig) -> FilePolicy | ServePolicy:
    """The policy of the config's mode: serve (``--serve``) or a request file."""
    return ServePolicy() if config.serve else FilePolicy()
