"""The OpenAI completions contract as evaluation suites read it: types, echo scoring, text_offset,: the runs that start processes (the rest: tests/unit/pipeline/output/test_openai_contract.py)."""

from __future__ import annotations

import json
from tests.utils import DATA, assert_consistent_results, local_tokenizer, read_jsonl, run_torchrun, write_jsonl
from tests.unit.pipeline.output.test_openai_contract import _hf_loglik, check_offsets, model_dir, run  # noqa: F401 (fixtures and helpers)


def test_echo_scoring_matches_hf_loglikelihood_p1_and_p2(model_dir, tmp_path):
    requests = [json.loads(l) for l in (DATA / "helm_scoring.jsonl").read_text().splitlines()[:8]]
    tok = local_tokenizer()
    out1 = run(model_dir, tmp_path, requests)
    src = write_jsonl(tmp_path / "helm.jsonl", requests)
    p = run_torchrun(["--model-name", model_dir, "--infer-data", src, "--output-path", str(tmp_path / "p2.jsonl")], 2)
    assert p.returncode == 0, p.stderr[-3000:]
    out2 = read_jsonl(tmp_path / "p2.jsonl")
    assert_consistent_results(out1, out2)  # scoring only: logprobs within 1e-4
    for req, line in zip(requests, out1, strict=True):
        c = line["result"]["choices"][0]
        assert c["finish_reason"] == "length" and c["text"] == req["prompt"]
        assert line["result"]["usage"]["completion_tokens"] == 0
        ids = tok(req["prompt"])["input_ids"]
        assert len(c["logprobs"]["tokens"]) == len(ids)
        ours = sum(c["logprobs"]["token_logprobs"][1:])
        assert abs(ours - _hf_loglik(model_dir, ids)) < 1e-3
        check_offsets(c)
        assert all(1 <= len(t) <= 5 for t in c["logprobs"]["top_logprobs"][1:])  # equal strings collapse
