"""The scheduler's pass is complete and immutable: every decision a stage needs (rows, decode layout
and columns, each prompt's part with its chunk end and prefix pool loads/saves, forks, adapters,
releases, drops) is in the :class:`Pass` it returns, and the scheduler is told the outcome."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.cache.prefix import PrefixCache, block_digests
from pipeline.scheduling.scheduler import chunk_end, decode_layout
from pipeline.scheduling.batches import Group, Outcome, Pass, PromptPart
from pipeline.scheduling.scheduler import Scheduler, SchedulerConfig, ServePolicy


def test_a_pass_is_frozen_and_holds_tuples():
    s = Scheduler(SchedulerConfig(budget=1000, num_slots=1, max_rows=4))
    s.submit(Group(0, prompt_len=6, max_tokens=3, width=2))
    ps = s.next_pass(0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ps.rows = 9  # type: ignore[misc]
    for f in dataclasses.fields(Pass):
        assert not isinstance(getattr(ps, f.name), (list, dict, set)), f.name
    assert ps.prompts == (PromptPart(0, 0, 6, 6, ends=False),)
    assert ps.forks == ((0, (1,), 6),) and ps.admitted == ((0, (0, 1)),) and ps.alloc == (2, 9)


def test_chunk_ends_and_where_each_chunk_resumes_are_the_schedulers():
    """A 100-token chunkable prompt with chunks of 32: parts 0-32, 32-64, 64-96, 96-100, then it
    decodes from column 100; a prompt that is not chunkable is computed whole in its first pass."""
    s = Scheduler(SchedulerConfig(budget=10_000, num_slots=1, max_rows=4, chunk=32))
    s.submit(Group(0, prompt_len=100, max_tokens=9, chunkable=True))
    s.submit(Group(1, prompt_len=50, max_tokens=9))
    parts = []
    for _ in range(4):
        ps = s.next_pass(0)
        parts.append([(p.gid, p.cached, p.end, p.partial, p.resumed) for p in ps.prompts])
        s.on_reply(0, [*ps.decode_rows, *(p.row for p in ps.prompts if not p.partial)], [])
    assert parts == [[(0, 0, 32, True, False), (1, 0, 50, False, False)], [(0, 32, 64, True, True)],
                     [(0, 64, 96, True, True)], [(0, 96, 100, False, True)]]
    ps = s.next_pass(0)
    assert ps.prompts == () and sorted(ps.decode_rows) == [0, 1] and ps.column(0) == 100 and ps.column(1) == 53


def test_prefix_loads_and_saves_are_in_the_pass():
    """Two prompts sharing 3 blocks of 4: the first saves the shared blocks (the second shows them),
    the second waits a pass, then loads them and computes only its tail."""
    pc = PrefixCache(4, budget=1000)
    shared = list(range(10, 22))
    a, b = shared + [1, 2], shared + [3]
    s = Scheduler(SchedulerConfig(budget=1000, num_slots=1, max_rows=4), prefix=pc)
    for gid, ids in enumerate((a, b)):
        d = tuple(block_digests(ids, 4))
        pc.queued(d)
        s.submit(Group(gid, len(ids), 1, digests=d))
    first = s.next_pass(0)
    (p,) = first.prompts
    assert (p.gid, p.cached, p.load, [i for i, _ in p.save]) == (0, 0, (), [0, 1, 2])
    assert first.prefix_grow is not None and first.prefix_grow >= 3
    assert s.on_reply(0, [], [p.row]).released  # its one token: the slot empties, the pool stays
    second = s.next_pass(0)
    (q,) = second.prompts
    assert (q.gid, q.cached, q.load) == (1, 12, tuple(b for _, b in p.save)) and q.save == ()


def test_adapters_releases_and_drops_ride_with_the_pass():
    s = Scheduler(SchedulerConfig(budget=1000, num_slots=2, max_rows=4, serve=True))
    assert isinstance(s.policy, ServePolicy)
    s.submit(Group(0, 5, 3, adapter=2, request=7))
    s.submit(Group(1, 5, 3, request=8))
    ps = s.next_pass(0)
    rows = dict(ps.admitted)
    assert ps.adapters[rows[0][0]] == 2 and ps.adapters[rows[1][0]] == 0
    gone, held = s.cancel({1}, 8)  # admitted already: its slot drops request 8 with its next pass
    assert gone == [] and held == [0]
    out = s.on_reply(0, [rows[0][0]], [rows[1][0]])
    assert out == Outcome((1,), False)
    ps = s.next_pass(0)
    assert ps.drop == (8,) and ps.release == ()
    out = s.on_reply(0, [], [rows[0][0]])
    assert out.released and s.take_released() == [0] and s.take_released() == []


def test_a_released_slot_goes_with_the_next_pass_of_any_slot():
    s = Scheduler(SchedulerConfig(budget=1000, num_slots=2, max_rows=4))
    s.submit(Group(0, 5, 1))
    ps = s.next_pass(0)
    assert s.on_reply(0, [], [r for r in dict(ps.admitted)[0]]).released
    s.submit(Group(1, 5, 1))
    assert s.next_pass(1).release == (0,)


def test_cancel_takes_queued_groups_and_shed_empties_the_queue():
    s = Scheduler(SchedulerConfig(budget=1000, num_slots=1, max_rows=1))
    for gid in range(4):
        s.submit(Group(gid, 5, 2, request=gid))
    s.next_pass(0)
    gone, held = s.cancel({2}, 2)
    assert [g.gid for g in gone] == [2] and held == [] and [g.gid for g in s.queue] == [1, 3]
    assert [g.gid for g in s.shed()] == [1, 3] and s.queued == 0 and not s.empty


def test_counters_for_status():
    s = Scheduler(SchedulerConfig(budget=1000, num_slots=1, max_rows=4))
    assert (s.queued, s.running_rows, s.used, s.empty) == (0, 0, 0, True)
    for gid in range(3):
        s.submit(Group(gid, 5, 5))
    assert s.queued == 3 and s.wants_more
    ps = s.next_pass(0)
    assert s.running_rows == 3 and s.used == ps.alloc[0] * ps.alloc[1] and s.slots[0].fed


def test_helpers():
    g = Group(0, 10, 4, chunkable=True)
    assert chunk_end(4, g, 0) == 4 and chunk_end(4, g, 8) == 10 and chunk_end(0, g, 0) == 10
    assert chunk_end(4, Group(1, 10, 4), 0) == 10
    assert decode_layout([0, 1], 4) == [0, 1, 2, 3] and decode_layout([0], 4) == [0]
    assert decode_layout([0, 1], 4, dense=False) == [0, 1]
