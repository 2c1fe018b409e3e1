"""Stage sizes: --layers-per-stage (explicit, unequal) and --stage-memory (layers in proportion to each
stage's memory): the pure split, the plan's messages, unequal layouts equal to HF at P = 2 and 3, and
mistakes that exit 2 before anything loads."""

from __future__ import annotations

import pytest
import torch

from pipeline.config.options import UsageError, parse_options
from pipeline.config.partition import memory_sizes, parse_size, stage_ranges
from pipeline.config.plan import make_plan
from tests.utils import chain_greedy, chain_logits, hf_greedy, hf_logits, stage_chain

GIB = 2**30


@pytest.mark.parametrize("total, stages, sizes, max_layers, expect", [
    (48, 4, [10, 14, 14, 10], None, [(0, 10), (10, 24), (24, 38), (38, 48)]),
    (4, 2, [1, 3], None, [(0, 1), (1, 4)]),
    (6, 3, [1, 1, 2], 4, [(0, 1), (1, 2), (2, 4)]),
])
def test_explicit_sizes(total, stages, sizes, max_layers, expect):
    assert stage_ranges(total, stages, max_layers=max_layers, sizes=sizes) == expect


@pytest.mark.parametrize("total, stages, sizes, max_layers, message", [
    (48, 4, [10, 14, 14, 9], None, "adds up to 47, but the sizes must add up to 48 (the model's 48 layers)"),
    (6, 2, [2, 3], 4, "must add up to 4 (--max-layers 4)"),
    (4, 2, [1, 1, 2], None, "has 3 sizes for 2 pipeline stages"),
    (4, 2, [0, 4], None, "at least 1 layer"),
])
def test_bad_explicit_sizes(total, stages, sizes, max_layers, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        stage_ranges(total, stages, max_layers=max_layers, sizes=sizes)


@pytest.mark.parametrize("costs, first, last, memory, expect", [
    ([1] * 48, 0, 0, [20, 40, 40, 20], [8, 16, 16, 8]),  # in proportion to memory
    ([1] * 8, 0, 0, [100, 100], [4, 4]),
    ([10] * 8, 30, 5, [60, 100], [2, 6]),  # the embedding takes room on the first stage
    ([10] * 8, 0, 40, [100, 100], [5, 3]),  # the head on the last (rooms 100 and 60)
    ([10] * 4 + [30] * 2, 0, 0, [100, 100], [4, 2]),  # heavier layers (e.g. MoE) count as such
    ([10] * 3, 0, 0, [10, 1000, 10], [1, 1, 1]),  # every stage gets a layer
])
def test_memory_split(costs, first, last, memory, expect):
    assert memory_sizes(costs, first, last, memory) == expect


def test_memory_that_cannot_fit_says_by_how_much():
    with pytest.raises(ValueError, match=r"needs 12\.00 GiB .* stages have 10\.00 GiB: 2\.00 GiB short"):
        memory_sizes([GIB] * 10, GIB, GIB, [5 * GIB, 5 * GIB])
    with pytest.raises(ValueError, match=r"stage 1 needs .* left after the head: .* short, though the total fits"):
        memory_sizes([GIB] * 4, 0, 3 * GIB, [8 * GIB, 3 * GIB + GIB // 2])
    assert parse_size("20GiB") == 20 * GIB and parse_size("1.5GB") == 1_500_000_000 and parse_size("512") == 512
    with pytest.raises(ValueError, match="not a size"):
        parse_size("20 gigs")


def plan(model, *flags, world=2, local_world=None):
    env = {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local_world or world)}
    return make_plan(parse_options(["--model-name", model, *flags]), env=env, cpu_count=2)


def test_plans(make_llama):
    model = make_llama(num_hidden_layers=4)
    assert plan(model, "--layers-per-stage", "1,3").ranges == [(0, 1), (1, 4)]
    assert plan(model, "--layers-per-stage", "1,2", "--max-layers", "3").ranges == [(0, 1), (1, 3)]
    p = plan(model, "--stage-memory", "1MiB,3MiB", "--budget", "64")
    assert p.ranges == [(0, 1), (1, 4)] and "stage 1: layers 1-3 (3)" in p.layout_note
    p = plan(model, "--stage-memory", "auto", "--budget", "64", local_world=2)
    assert "available RAM" in p.layout_note and "divided among 2 local process" in p.layout_note
    for flags, message in [(["--layers-per-stage", "1,2"], "must add up to 4 (the model's 4 layers)"),
                           (["--layers-per-stage", "1,1,2"], "3 sizes for 2 pipeline stages"),
                           (["--stage-memory", "100KiB"], "short"),
                           (["--stage-memory", "1GiB,1GiB,1GiB"], "3 sizes for 2 pipeline stages")]:
        with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
            plan(model, *flags)


@pytest.mark.parametrize("ranges", [[(0, 1), (1, 4)], [(0, 2), (2, 3), (3, 4)]], ids=["P2-1+3", "P3-2+1+1"])
def test_unequal_layouts_match_hf(make_llama, ranges):
    model = make_llama(num_hidden_layers=4)
    chain = stage_chain(model, ranges)
    prompts = [[5, 9, 13, 2, 7], [3, 4, 8, 30, 31, 32, 33]]
    for prompt, ours in zip(prompts, chain_logits(chain, prompts), strict=True):
        torch.testing.assert_close(ours, hf_logits(model, prompt), atol=1e-4, rtol=1e-4)
    toks, _ = chain_greedy(chain, prompts, 4)
    assert toks == [hf_greedy(model, p, 4)[0] for p in prompts]


