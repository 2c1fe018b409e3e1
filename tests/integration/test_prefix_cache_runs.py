"""Shared-prefix KV cache: answers equal the cache-off answers (generation, echo scoring, seeded: the runs that start processes (the rest: tests/unit/pipeline/cache/test_prefix.py)."""

from __future__ import annotations

import json
import pytest
from tests.utils import read_jsonl, run_single, run_torchrun
from tests.unit.pipeline.cache.test_prefix import assert_same_answers, model_dir, reference, workload  # noqa: F401 (fixtures and helpers)


@pytest.mark.parametrize("stages, extra", [(2, ["--prefill-chunk", "48", "--budget", "8192"]),
                                           (3, ["--budget", "520", "--max-micro-batch-size", "3"])])
def test_pipelines_and_a_tiny_budget_equal_cache_off(model_dir, workload, reference, tmp_path, stages, extra):
    """P = 2 with chunked prefill (48 tokens a pass), and P = 3 with a budget so small that blocks are
    evicted and recomputed mid-file; the stages never hold more KV cells (micro-batches + pool) than
    --budget."""
    out = tmp_path / "on.jsonl"
    p = run_torchrun(["--model-name", model_dir, "--infer-data", workload, "--output-path", str(out), *extra], stages)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = read_jsonl(out)
    assert_same_answers(lines, reference)
    summary = json.loads((tmp_path / "on.jsonl.summary.json").read_text())
    budget = int(extra[extra.index("--budget") + 1])
    assert 0 < summary["kv_cells_peak"] <= budget
    assert summary["cached_prompt_tokens"] > 0


def test_kill_and_resume_with_the_cache_equals_cache_off(model_dir, workload, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    args = ["--model-name", model_dir, "--infer-data", workload, "--output-path", str(out), "--budget", "900"]
    assert run_single(args, env={"DIST_INFER_FAULT": "midgen", "DIST_INFER_FAULT_RANK": "0"}).returncode != 0
    p = run_single(args)
    assert p.returncode == 0 and "resuming after" in p.stderr, p.stderr[-3000:]
    assert_same_answers(read_jsonl(out), reference)
