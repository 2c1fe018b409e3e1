"""Crash isolation by bisection (pipeline.scheduling.isolation with tasks.inflight's records): runs are
simulated as the engine drives them, a process "dying" whenever a poison line is in flight."""

from __future__ import annotations

import pytest

from pipeline.scheduling.isolation import Isolation
from tasks.inflight import InFlight, inflight_path, replay


def run_once(path, written: int, poison: set[int], normal: list[int]) -> tuple[bool, set[int], set[int]]:
    """One run: the suspects probed in order beside ``normal`` lines (a micro-batch of them in flight with
    each probe). Returns (crashed, lines answered, culprits known when it opened)."""
    rec = InFlight(path)
    suspects, culprits = rec.open(written)
    iso = Isolation(suspects, culprits)
    for i in suspects:
        iso.holds(i, b"{}")
    answered = set(culprits)
    beside = iter(normal)
    while (probe := iso.next_probe(exhausted=True, empty=True)) is not None:
        lines, alone, group = probe
        indices = [i for i, _ in lines]
        others = [] if alone else [next(beside, None) for _ in range(4)]
        others = [i for i in others if i is not None]
        rec.admitted(others, indices if alone else [], [] if alone else indices, group)
        if poison & (set(indices) | set(others)):
            rec._file.close()  # killed: no "stopped" record
            return True, answered, set(culprits)
        answered |= set(indices) | set(others)
        iso.started([1], alone)
        assert iso.finished([1])
    rec.close(False)
    return False, answered, set(culprits)


@pytest.mark.parametrize("k, poison", [(64, 37), (64, 0), (64, 63), (7, 3), (2, 1), (1, 0)])
def test_a_poison_line_among_k_suspects_is_cornered_in_log2_k_runs(tmp_path, k, poison):
    path = tmp_path / "out.partial"
    rec = InFlight(path)
    rec.open(0)
    rec.admitted(list(range(k)), [])  # the first run dies with k lines in flight
    rec._file.close()
    runs, culprit_found = 1, None
    normal = list(range(1000, 1100))
    while culprit_found is None:
        crashed, _, culprits = run_once(path, 0, {poison}, normal)
        runs += 1
        if poison in culprits:
            culprit_found = runs
        assert runs < 20
    # known as the culprit when the run after it died alone opens: runs 1 (the crash) .. log2(k) + 1
    assert culprit_found - 1 <= max(1, (k - 1).bit_length()) + 1, culprit_found
    assert runs <= 8 or k < 64


def test_innocent_suspects_are_answered_and_a_stop_blames_nobody(tmp_path):
    path = tmp_path / "out.partial"
    rec = InFlight(path)
    rec.open(0)
    rec.admitted([1, 2, 3, 4], [])
    rec._file.close()  # a crash: four suspects
    assert replay(inflight_path(path), 0) == ({1, 2, 3, 4}, set())
    crashed, answered, _ = run_once(path, 0, set(), [])  # nothing poisons them this time
    assert not crashed and {1, 2, 3, 4} <= answered
    rec = InFlight(path)
    assert rec.open(5) == ([], [])  # that run ended (lines 0-4 journaled): nothing is suspected any more
    rec.admitted([5, 6], [])
    rec.stopped()  # a signal: nobody is blamed
    rec._file.close()
    assert replay(inflight_path(path), 5) == (set(), set())


def test_a_crash_during_a_probe_blames_the_probe_not_the_lines_beside_it(tmp_path):
    path = tmp_path / "out.partial"
    rec = InFlight(path)
    rec.open(0)
    rec.admitted([10, 11], [], [3, 4], 1)
    rec._file.close()
    assert replay(inflight_path(path), 0) == ({3, 4}, set())
    iso = Isolation({3, 4})
    assert iso.plan == [[3], [4]]
    iso.holds(3, b"x")
    assert iso.next_probe(exhausted=False, empty=False) is None and iso.draining  # alone: waits to be alone
    lines, alone, group = iso.next_probe(exhausted=False, empty=True)
    assert lines == [(3, b"x")] and alone and group == 1 and not iso.draining
