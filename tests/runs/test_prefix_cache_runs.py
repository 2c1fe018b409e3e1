"""The shared-prefix KV cache through the runner at P = 2 and 3, in one process (``--in-process``): the
answers equal the cache-off ones (and HF's), with chunked prefill and passes ahead (default flags at
P > 1; chunks that end inside blocks), and under a budget so small that blocks are evicted and
recomputed mid-file; the stages never hold more KV cells than --budget. Rank 0's passes against a
stand-in stage: tests/unit/pipeline/cache/test_prefix_chunked.py; P = 1: tests/unit/pipeline/cache/test_prefix.py."""

import json

import pytest

from tests.unit.pipeline.cache.test_prefix import (assert_same_answers, cached, model_dir, reference,  # noqa: F401
                                                    workload)
from tests.unit.pipeline.cache.test_prefix_chunked import fewshot
from tests.utils import hf_greedy, local_tokenizer, read_jsonl, run_inprocess, run_local, write_jsonl


@pytest.mark.parametrize("stages, extra", [(2, ["--prefill-chunk", "48", "--budget", "8192"]),
                                           (3, ["--budget", "520", "--max-micro-batch-size", "3"])])
def test_pipelines_and_a_tiny_budget_equal_cache_off(model_dir, workload, reference, tmp_path, stages,  # noqa: F811
                                                     extra):
    """P = 2 with chunked prefill (48 tokens a pass), and P = 3 with a budget so small that blocks are
    evicted and recomputed mid-file; the stages never hold more KV cells (micro-batches + pool) than
    --budget."""
    out = tmp_path / "on.jsonl"
    p = run_local(["--model-name", model_dir, "--infer-data", workload, "--output-path", str(out), *extra], stages)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = read_jsonl(out)
    assert_same_answers(lines, reference)
    summary = json.loads((tmp_path / "on.jsonl.summary.json").read_text())
    budget = int(extra[extra.index("--budget") + 1])
    assert 0 < summary["kv_cells_peak"] <= budget
    assert summary["cached_prompt_tokens"] > 0


@pytest.fixture(scope="module")
def fewshot_run(make_llama, tmp_path_factory):
    """A few-shot file (a 300-token prefix: 18.75 blocks of 16, ending mid-chunk) of greedy requests,
    one echo scoring request and one best_of over the same prefix, and its answers with the prefix
    cache off at P = 1 (no chunks)."""
    model = make_llama(num_hidden_layers=3, max_position_embeddings=1024)
    reqs = fewshot(300, 8, seed=0)
    for r in reqs:
        if r.get("max_tokens") and not r.get("best_of"):
            r.update(max_tokens=4, logprobs=1)
    path = write_jsonl(tmp_path_factory.mktemp("fewshot") / "fewshot.jsonl", reqs)
    out = path + ".off"
    assert run_inprocess(["--model-name", model, "--infer-data", path, "--output-path", out,
                          "--prefix-cache", "off", "--no-progress"]) == 0
    return model, path, reqs, read_jsonl(out)


@pytest.mark.parametrize("stages, extra", [(2, []), (3, []), (3, ["--prefill-chunk", "40"])])
def test_default_flags_at_p2_p3_share_a_fewshot_prefix(fewshot_run, tmp_path, stages, extra):
    """Default flags (chunked prefill of 64 at P > 1, passes ahead; chunks of 40 end inside blocks):
    every request sharing the prefix after the first reports its 288 block tokens cached, most prompt
    tokens are cached, the summary counts the same, and the answers equal the cache-off ones and
    HF's (greedy tokens, logprobs within 1e-4; the echo request's prompt logprobs too)."""
    model, path, reqs, ref = fewshot_run
    out = tmp_path / "out.jsonl"
    p = run_local(["--model-name", model, "--infer-data", path, "--output-path", str(out), *extra], stages)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = read_jsonl(out)
    assert_same_answers(lines, ref)
    hits = cached(lines)
    sharing = [h for r, h in zip(reqs, hits) if len(r["prompt"]) > 300]
    assert sharing[0] == 0 and all(h == 288 for h in sharing[1:]), hits
    prompt_tokens = sum(x["result"]["usage"]["prompt_tokens"] for x in lines)
    assert sum(hits) > 0.7 * prompt_tokens
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert summary["cached_prompt_tokens"] == sum(hits)
    for r, x in zip(reqs, lines):
        if r.get("logprobs") == 1 and r["max_tokens"]:  # greedy: HF's tokens and logprobs
            tokens, lps = hf_greedy(model, r["prompt"], r["max_tokens"])
            choice = x["result"]["choices"][0]
            assert choice["text"] == local_tokenizer().decode(tokens, skip_special_tokens=True)
            assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], lps, strict=True)) < 1e-4
