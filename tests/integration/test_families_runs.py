"""Qwen3, Gemma 1/2/3, Phi-3/4, OLMo 2 and sliding-window Mistral/Qwen parity with HuggingFace: the runs that start processes (the rest: tests/unit/pipeline/models/families/test_qwen3_gemma_phi3_olmo2.py)."""

from __future__ import annotations

import torch
from tests.utils import hf_greedy, hf_logits, local_tokenizer, random_hf_model, read_jsonl, run_torchrun, write_jsonl
from tests.unit.pipeline.models.families.test_qwen3_gemma_phi3_olmo2 import PROMPTS, VARIANTS  # noqa: F401 (fixtures and helpers)


def test_runner_p2_echo_scoring_and_greedy_match_hf(tmp_path):
    """Through the CLI at P = 2: Gemma 3 (local/global layers, window 4) echo-scores prompts several
    windows long and generates greedily, as HF does."""
    model_type, overrides = VARIANTS["gemma3"]
    path = random_hf_model(tmp_path / "gemma3", model_type, **overrides)
    requests = [{"prompt": p, "echo": True, "logprobs": 1, "max_tokens": 0} for p in PROMPTS]
    requests += [{"prompt": p, "max_tokens": 5, "temperature": 0, "logprobs": 0} for p in PROMPTS]
    src = write_jsonl(tmp_path / "requests.jsonl", requests)
    out = tmp_path / "out.jsonl"
    proc = run_torchrun(["--model-name", path, "--infer-data", src, "--output-path", str(out), "--no-progress"], 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_jsonl(out)
    for prompt, line in zip(PROMPTS, lines[: len(PROMPTS)], strict=True):
        lps = line["result"]["choices"][0]["logprobs"]["token_logprobs"]
        ref = torch.log_softmax(hf_logits(path, prompt), -1)
        assert lps[0] is None and len(lps) == len(prompt)
        assert max(abs(lps[i] - float(ref[i - 1, prompt[i]])) for i in range(1, len(prompt))) < 1e-4
    tok = local_tokenizer()
    for prompt, line in zip(PROMPTS, lines[len(PROMPTS):], strict=True):
        toks, _ = hf_greedy(path, prompt, 5)
        assert line["result"]["choices"][0]["text"] == tok.decode(toks)
