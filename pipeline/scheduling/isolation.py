"""Rank 0: the suspects of an earlier crash, found by bisection while the rest of the file runs.

The lines a dead process had in flight are the next run's *suspects* (tasks.inflight), probed in halves
beside the rest of the file: a half that is answered is innocent; a run that dies with a probe group in
flight blames that group alone, whose halves the next run probes. A single suspect runs *alone*
(nothing else in flight); one that dies alone is the *culprit*, answered with an error by the run
after (docs/usage/recovery.md). A run stopped by a signal blames nobody.
"""

from __future__ import annotations


class Isolation:
    def __init__(self, suspects=(), culprits=()):
        self.suspects, self.culprits = set(suspects), set(culprits)
        self.active = bool(self.suspects or self.culprits)  # (both fixed for the file)
        order = sorted(self.suspects)
        self.plan: list[list[int]] = [order] if len(order) == 1 else \
            [order[: (len(order) + 1) // 2], order[(len(order) + 1) // 2 :]] if order else []
        self.aside: dict[int, bytes] = {}  # suspect lines read, waiting for their probe
        self.group = 0  # the probe group in flight (numbered from 1 in a run), 0: none
        self.probes = 0  # groups started in this run
        self.running: set[int] = set()  # its scheduler groups not answered yet
        self.draining = False  # a lone suspect waits for the pipeline to empty: nothing more is read
        self.alone = False  # a lone suspect runs: nothing else enters until it is answered

    def holds(self, index: int, line: bytes) -> bool:
        """A suspect line is set aside for its probe (True); any other line runs as it comes."""
        if index not in self.suspects:
            return False
        self.aside[index] = line
        return True

    def next_probe(self, exhausted: bool, empty: bool) -> tuple[list[tuple[int, bytes]], bool, int] | None:
        """The next group to run, when its lines are read and none is in flight: (lines, alone, group
        number); None for now. ``exhausted``: the file is read to its end; ``empty``: nothing in flight."""
        if self.group or self.alone or not self.plan:
            return None
        lines = [i for i in self.plan[0] if i in self.aside]
        if len(lines) < len(self.plan[0]) and not exhausted:
            return None  # some of its lines are not read yet
        alone = len(self.plan[0]) == 1
        if alone and not empty:
            self.draining = True  # it waits for the pipeline to empty
            return None
        self.plan.pop(0)
        self.draining = False
        if not lines:
            return self.next_probe(exhausted, empty)
        self.probes += 1
        self.group = self.probes
        return [(i, self.aside.pop(i)) for i in lines], alone, self.group

    def started(self, gids: list[int], alone: bool) -> None:
        """The probe's scheduler groups (none when its lines were answered at once: refused, culprits)."""
        self.running = set(gids)
        self.alone = alone and bool(gids)
        if not gids:
            self.group = 0

    def finished(self, gids) -> bool:
        """Groups were answered; True when the probe in flight is over (the next may start)."""
        if not self.running:
            return False
        self.running.difference_update(gids)
        if self.running:
            return False
        self.alone = False
        self.group = 0
        return True
