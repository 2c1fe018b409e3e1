"""The memory check before loading (pipeline/config/fit.py and the plan): a plan that fits passes,
one that cannot is refused with each stage's numbers and what would fit; nothing is loaded."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import fit, plan as plan_mod
from pipeline.config.options import UsageError, parse_options
from pipeline.config.plan import make_plan

GiB = 1 << 30
CPU = torch.device("cpu")


def test_stage_needs_put_the_embedding_first_and_the_head_last():
    needs = fit.stage_needs([10, 10, 10, 10], [1, 1, 1, 1], 100, 200, [(0, 1), (1, 3), (3, 4)])
    assert [(n.weights, n.kv) for n in needs] == [(110, 1), (20, 2), (210, 1)]
    assert needs[0].total == int(111 * (1 + fit.SLACK)) + fit.PROCESS_BYTES


@pytest.mark.parametrize("rank,local_world,pipeline,want", [
    (0, 2, 2, [0, 1]), (3, 2, 2, [0, 1]), (5, 4, 4, [0, 1, 2, 3]), (2, 2, 4, [2, 3]), (1, 4, 2, [0, 1, 0, 1])])
def test_local_stages(rank, local_world, pipeline, want):
    assert fit.local_stages(rank, local_world, pipeline) == want


def test_cpu_stages_on_one_node_share_its_ram():
    needs = fit.stage_needs([4 * GiB] * 4, [0] * 4, 0, 0, [(0, 2), (2, 4)])
    assert fit.fit_problem(needs, [1], 10 * GiB, CPU) is None  # one stage here: 8 GiB + process
    problem = fit.fit_problem(needs, [0, 1], 10 * GiB, CPU)
    assert problem and "2 process(es)" in problem and "stage 0: 9.55 GiB" in problem and "short" in problem


def test_gpu_stages_are_checked_against_their_device():
    needs = fit.stage_needs([4 * GiB] * 2, [0] * 2, 0, 0, [(0, 1), (1, 2)])
    gpu = torch.device("cuda")
    assert fit.fit_problem(needs, [0, 1], 0, gpu, [6 * GiB, 6 * GiB]) is None
    assert "stage 1 needs" in fit.fit_problem(needs, [0, 1], 0, gpu, [6 * GiB, 4 * GiB])


def test_suggestions_name_the_changes_that_would_fit():
    tips = " ".join(fit.suggestions(30 * GiB, 1 * GiB, torch.float32, 20 * GiB, 2))
    assert "at least 2 nodes" in tips and "--dtype bfloat16" in tips and "--quantize int8" in tips
    assert "--budget" not in tips  # the cache is a small part here
    assert "--budget" in " ".join(fit.suggestions(1 * GiB, 3 * GiB, torch.bfloat16, 2 * GiB, 1))


def test_the_plan_refuses_before_loading(llama_2l, monkeypatch):
    tmp_llama = llama_2l
    opts = parse_options(["--model-name", tmp_llama, "--dtype", "float32"])
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert make_plan(opts, env).pipeline == 2  # plenty of RAM: the plan fits
    monkeypatch.setattr(plan_mod, "available_ram", lambda: 1 * GiB)  # two processes cannot fit in 1 GiB
    with pytest.raises(UsageError, match=r"the plan does not fit: .*2 process\(es\).*--no-memory-check"):
        make_plan(opts, env)
    assert make_plan(parse_options(["--model-name", tmp_llama, "--no-memory-check"]), env).pipeline == 2
    assert make_plan(parse_options(["--model-name", tmp_llama, "--stage-memory", "1GiB"]), env).pipeline == 2


def test_a_tied_table_counts_once_on_a_stage_holding_both_ends():
    one = fit.stage_needs([10, 10], [1, 1], 100, 130, [(0, 2)], shared=120)
    assert [(n.weights, n.kv) for n in one] == [(20 + 100 + 130 - 120, 2)]
    two = fit.stage_needs([10, 10], [1, 1], 100, 130, [(0, 1), (1, 2)], shared=120)
    assert [(n.weights, n.kv) for n in two] == [(110, 1), (140, 1)]  # each end its own copy
