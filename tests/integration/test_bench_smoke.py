"""Smoke test of bench/throughput.py: a tiny model, HF + runner P=1, JSON written with every figure.

No timing is asserted (the machine may be busy); only that the benchmark runs end to end, writes
the expected keys and computes greedy agreement.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "throughput.py"

FIGURES = {"generated_tokens", "scored_prompt_tokens", "gen_tokens_per_s", "scored_tokens_per_s", "gen_seconds",
           "score_seconds", "wall_seconds", "startup_and_load_seconds", "peak_rss_mb", "peak_rss_mb_per_process",
           "flops_per_s", "flops_fraction_of_peak", "stage_busy", "timing", "other_load_cores"}


def test_tiny_benchmark_writes_figures_and_agreement(tmp_path):
    out = tmp_path / "t.json"
    cmd = [sys.executable, str(BENCH), "--quick", "--tiny", "--systems", "hf,runner1,hf-bf16,runner1-bf16", "--json", str(out),
           "--work-dir", str(tmp_path / "work"), "--cache-dir", str(tmp_path / "cache"), "--timeout", "120"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=str(REPO))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["profile"] == "tiny"
    assert data["workload"]["requests"] == 12
    assert data["workload"]["score_requests"] >= 1 and data["workload"]["stop_requests"] >= 1
    assert not data["failures"], data["failures"]
    assert set(data["systems"]) == {"hf", "runner1", "hf-bf16", "runner1-bf16"}
    for name, figs in data["systems"].items():
        assert FIGURES <= set(figs), (name, FIGURES - set(figs))
        assert figs["generated_tokens"] > 0 and figs["peak_rss_mb"] > 0
    assert data["matmul_peak_flops"]["1"] > 0
    agreement = data["agreement"]["runner P=1 vs HF generate"]
    assert agreement["requests"] == 12
    assert 0.0 <= agreement["fraction"] <= 1.0 and agreement["agree"] + agreement["disagree"] == 12
    assert [t["status"] in ("PASS", "FAIL", "n/a") for t in data["targets"]] == [True] * 9  # bf16 targets, no int8 ones
    bf16 = [t for t in data["targets"] if "bf16" in t["target"]]
    assert len(bf16) == 2 and bf16[1]["value"] is not None  # (a tiny run's phases may round to 0.0 s: no speed ratio)
    for pair in ("runner P=1 bf16 vs runner P=1", "HF bf16 vs HF generate"):  # fidelity against float32
        f = data["fidelity"][pair]
        assert f["positions"] > 0 and 0.5 <= f["top1_agreement"] <= 1.0 and f["mean_abs_logprob_diff"] < 0.5
    assert "--dtype bfloat16" in data["systems"]["runner1-bf16"]["command"]
    assert "runner P=1 / HF (gen tok/s)" in data["ratios"]
    assert "Targets:" in p.stdout and "Greedy agreement" in p.stdout


def test_unknown_system_is_rejected():
    p = subprocess.run([sys.executable, str(BENCH), "--systems", "hf,vllm"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "vllm" in p.stderr


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
    """The plain reference (HF with fake-quantized weights) computes what the runner's dequantize kernel does."""
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


def test_native_vs_generic_bench_runs_and_agrees(tmp_path):
    """bench/native_vs_generic.py on a tiny Llama: both backends answer, ratios computed, outputs agree."""
    out = tmp_path / "nvg.json"
    cmd = [sys.executable, str(REPO / "bench" / "native_vs_generic.py"), "--hidden", "64", "--layers", "2",
           "--intermediate", "128", "--vocab", "1024", "--requests", "2", "--repeats", "1", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    row = json.loads(out.read_text())["rows"][0]
    assert set(row["ratios"]) == {"gen_tok_s", "score_tok_s", "peak_rss_mb"} and all(v > 0 for v in row["ratios"].values())
    assert row["agreement"]["greedy_equal"] == 2 and row["agreement"]["max_logprob_diff"] < 1e-4
    assert "generic/native" in p.stdout
