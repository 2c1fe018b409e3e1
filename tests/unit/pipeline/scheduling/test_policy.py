"""File and serve policies as objects the scheduler is given, and the config that holds its sizes."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.config.components import PREFILL_TOKENS, SchedulerConfig
from pipeline.scheduling.batches import Group
from pipeline.scheduling.policy import FilePolicy, ServePolicy, policy_for
from pipeline.scheduling.scheduler import Scheduler


def test_config_defaults_and_frozen():
    c = SchedulerConfig(budget=1000, num_slots=2, max_rows=8)
    assert (c.look_ahead, c.prefill_tokens, c.scoring_cap, c.chunk, c.stages, c.serve) == (
        64, PREFILL_TOKENS, PREFILL_TOKENS, 0, 1, False)
    assert SchedulerConfig(1000, 2, 32, window=16, prefill_tokens=2048, scoring_tokens=256).look_ahead == 16
    assert SchedulerConfig(1000, 2, 32).look_ahead == 128 and SchedulerConfig(1, 1, 1, scoring_tokens=9).scoring_cap == 9
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.budget = 5  # type: ignore[misc]


def test_the_config_chooses_the_policy_unless_one_is_given():
    assert isinstance(policy_for(SchedulerConfig(1000, 1, 4)), FilePolicy)
    assert isinstance(policy_for(SchedulerConfig(1000, 1, 4, serve=True)), ServePolicy)
    assert isinstance(Scheduler(SchedulerConfig(1000, 1, 4, serve=True)).policy, ServePolicy)
    given = ServePolicy(recent=4)
    assert Scheduler(SchedulerConfig(1000, 1, 4), policy=given).policy is given


def test_file_policy_sizes_a_micro_batch_to_its_groups_serve_leaves_free_rows():
    """The same request: a file's micro-batch is exactly its rows x need; the server's gets free rows
    sized for recent requests within its share of the budget (budget / micro-batches)."""
    shapes = {}
    for policy in (FilePolicy(), ServePolicy()):
        s = Scheduler(SchedulerConfig(budget=4096, num_slots=2, max_rows=8), policy=policy)
        s.submit(Group(0, 40, 24))
        shapes[policy.serve] = s.next_pass(0).alloc
    assert shapes[False] == (1, 64)
    rows, cols = shapes[True]
    assert rows == 8 and cols >= 64 and rows * cols <= 4096 // 2


def test_serve_policy_remembers_recent_needs():
    p = ServePolicy(recent=2)
    for need in (10, 300, 20, 30):
        p.submitted(Group(0, need, 0))
    assert list(p.recent) == [20, 30]  # only the last two


def test_only_the_file_policy_splits_the_end_of_a_file():
    for policy, parts in ((FilePolicy(), 2), (ServePolicy(), 1)):
        s = Scheduler(SchedulerConfig(budget=10_000, num_slots=3, max_rows=8, stages=2), policy=policy)
        s.submit(Group(0, 10, 4, width=3))
        ps = s.next_pass(0)
        s.on_reply(0, list(dict(ps.admitted)[0]), [])
        assert s.parts() == parts
