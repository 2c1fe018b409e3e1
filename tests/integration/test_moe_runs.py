"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE): HF parity for P = 1, 2, 3, experts: the runs that start processes (the rest: tests/unit/pipeline/models/families/test_moe.py)."""

from __future__ import annotations

import json
import torch
from tests.utils import hf_logits, local_tokenizer, read_jsonl, run_torchrun
from tests.unit.pipeline.models.families.test_moe import tiny_moe  # noqa: F401 (fixtures and helpers)


def test_echo_scoring_and_generation_through_the_cli(tmp_path):
    """P = 2 through torchrun: echo scoring of prompts (max_tokens 0) and a greedy generation, against HF."""
    from tests.utils import hf_greedy

    d = tiny_moe(tmp_path / "q3", "qwen3_moe")
    tok = local_tokenizer()
    texts = ["The kitchen is north of the hallway.", "Question: where is the garden?\nAnswer: the garden is"]
    lines = [{"prompt": t, "echo": True, "logprobs": 1, "max_tokens": 0} for t in texts]
    lines.append({"prompt": texts[0], "max_tokens": 4, "temperature": 0, "logprobs": 1})
    req, out = tmp_path / "req.jsonl", tmp_path / "out.jsonl"
    req.write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = run_torchrun(["--model-name", d, "--infer-data", str(req), "--output-path", str(out)], 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = read_jsonl(out)
    assert len(results) == len(lines)
    for text, line in zip(texts, results[: len(texts)], strict=True):
        ids = tok(text)["input_ids"]
        lp = line["result"]["choices"][0]["logprobs"]
        ref = torch.log_softmax(hf_logits(d, ids), -1)
        expected = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)
        assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], expected, strict=True)) < 1e-4
    ids = tok(texts[0])["input_ids"]
    ref_tokens, ref_lps = hf_greedy(d, ids, 4)
    choice = results[2]["result"]["choices"][0]
    assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], ref_lps, strict=True)) < 1e-4
    assert choice["text"] == tok.decode(ref_tokens, skip_special_tokens=True)
