"""bench/throughput.py's pieces without a run: its flags, the generation end it emulates for HF (the
runner's semantics), the int8 fidelity figures and the fake quantization of its HF reference. The
benchmark run end to end: tests/integration/test_bench_smoke.py."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "throughput.py"


def test_unknown_system_is_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        _bench_module().main(["--systems", "hf,vllm"])
    assert e.value.code == 2 and "vllm" in capsys.readouterr().err


@pytest.mark.parametrize(
    "ids_text, max_tokens, stops, want",
    [
        ("abc", 16, [], ("abc", "length")),  # no stop: the whole text
        ("abc", 16, ["c"], ("ab", "stop")),  # cut before the stop string
        ("abcabc", 16, ["c", "b"], ("a", "stop")),  # earliest of several stops
        ("abc", 1, ["c"], ("a", "length")),  # max_tokens first
    ],
)
def test_finish_generation_matches_runner_semantics(ids_text, max_tokens, stops, want):
    finish_generation = _bench_module().finish_generation

    tok = _local_tokenizer()
    ids = [tok.convert_tokens_to_ids(c) for c in ids_text]  # one token per character
    got = finish_generation(tok, ids, max_tokens, stops, eos=tok.eos_token_id)
    assert (got["text"], got["finish"]) == want
    # EOS ends the sequence and counts as a computed token
    got = finish_generation(tok, ids[:1] + [tok.eos_token_id] + ids[1:], 16, [], eos=tok.eos_token_id)
    assert (got["text"], got["generated"], got["finish"]) == (ids_text[0], 2, "stop")


def test_int8_fidelity_counts_top1_and_logprob_differences():
    fidelity = _bench_module().fidelity
    full = {"score": [{"logprobs": [-1.0, -2.0, -3.0], "top1": [5, 6, 7]}, {"logprobs": [-0.5], "top1": [9]}, None]}
    quant = {"score": [{"logprobs": [-1.1, -2.0, -2.7], "top1": [5, 8, 7]}, {"logprobs": [-0.5], "top1": [9]},
                       {"logprobs": [-1.0], "top1": [1]}]}  # the third has no float32 answer: not counted
    f = fidelity(quant, full)
    assert f["positions"] == 4 and f["top1_agreement"] == 0.75
    assert abs(f["mean_abs_logprob_diff"] - 0.1) < 1e-9 and abs(f["max_abs_logprob_diff"] - 0.3) < 1e-9


def test_hf_fake_quantization_is_the_runners_int8(make_llama):
    """The plain reference (HF with fake-quantized weights and per-token activations) computes what the runner's dequantize kernel does."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.loading.stage_weights import build_stage
    from pipeline.models.kernels.int8 import Int8Linear
    from tests.utils import chain_logits

    model_dir = make_llama(num_hidden_layers=2)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _bench_module().fake_quantize_layers(hf)
    stage = build_stage(model_dir, 0, 2, True, True, quantize="int8")[0]
    for m in stage.modules():
        if isinstance(m, Int8Linear):
            m.kernel = "dequantize"
    prompt = [1, 20, 30, 40, 50]
    with torch.no_grad():
        torch.testing.assert_close(chain_logits([stage], [prompt])[0], hf(torch.tensor([prompt])).logits[0],
                                   atol=1e-4, rtol=1e-4)


@functools.lru_cache(maxsize=1)
def _bench_module():
    """bench/throughput.py, imported by path (bench/ is a folder of scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_throughput", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=1)
def _local_tokenizer():
    from pipeline.loading.default_model import build_tokenizer

    return build_tokenizer()
