"""Pre-quantized checkpoints (pipeline/loading/quantized/): each format built from a random tiny
Llama (GPTQ / AWQ packed from their documented layouts, compressed-tensors by its own library),
loaded by the runner's stages at P = 1 and 2 and compared with transformers running the same
dequantized weights (for FP8 checkpoints that quantize activations, with compressed-tensors' own
``fake_quantize`` on every projection's input): logits within 1e-4, greedy tokens equal, logprobs
within 1e-4 (the runner dequantizes exactly what the reference holds; only float summation order
differs). Also: the kernels against each other, what a stage reads, the configs refused, sizing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.config.sizing import model_costs
from pipeline.loading.quantized import UnsupportedQuantization, checkpoint_format
from pipeline.loading.stage_weights import build_stage, read_config
from pipeline.models.families import spec_from_config
from pipeline.models.kernels.weight_only import IntWeight, QuantLinear, choose_kernels
from tests import quant_checkpoints as qk
from tests.utils import chain_greedy, chain_logits, stage_chain

TOL = 1e-4
PROMPTS = [[1, 5, 9, 20, 33, 40, 41], [1, 7, 7]]
FORMATS = {
    "gptq-int4-g32-sym": ("gptq", dict(bits=4, group=32)),
    "gptq-int4-v1-asym": ("gptq", dict(bits=4, group=32, sym=False)),
    "gptq-int8-channel-asym": ("gptq", dict(bits=8, group=-1, sym=False)),
    "gptq-int4-desc-act-v2": ("gptq", dict(bits=4, group=16, desc_act=True, sym=False, v2=True)),
    "awq-gemm-g32": ("awq", dict(group=32)),
    "ct-w4a16-g32": ("ct", dict(preset="W4A16", group_size=32)),
    "ct-w4a16-asym-g16": ("ct", dict(preset="W4A16_ASYM", group_size=16)),
    "ct-w8a16-channel": ("ct", dict(preset="W8A16", strategy="channel", group_size=None)),
    "ct-fp8-dynamic": ("ct", dict(preset="FP8_DYNAMIC")),
    "ct-fp8-static": ("ct", dict(preset="FP8")),
    "ct-fp8-block": ("ct", dict(preset="FP8_BLOCK", acts=dict(group_size=32), block_structure=[32, 32])),
}


@pytest.fixture(scope="module")
def base(make_llama) -> str:
    return make_llama(seed=3)


@pytest.fixture(scope="module")
def built(base, tmp_path_factory):
    """``built(key) -> (quantized folder, reference folder, quantization_config)``, once per format."""
    cache: dict[str, tuple] = {}

    def build(key: str):
        if key not in cache:
            kind, kw = FORMATS[key]
            d = tmp_path_factory.mktemp(key)
            if kind == "ct":
                kw = dict(kw)
                cache[key] = qk.compressed_tensors(base, d / "q", d / "ref", kw.pop("preset"), kw.pop("acts", None), **kw)
            else:
                out, ref = getattr(qk, kind)(base, d / "q", d / "ref", **kw)
                cache[key] = (out, ref, json.loads((Path(out) / "config.json").read_text())["quantization_config"])
        return cache[key]

    return build


def _reference(ref: str, qc: dict):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    group = (qc.get("config_groups") or {}).get("group_0") or {}
    if group.get("input_activations"):
        qk.act_quant_hooks(model, qc)
    return model


@torch.inference_mode()
def _hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    ids, toks, lps = list(prompt), [], []
    for _ in range(steps):  # plain loop: every step a full forward, the hooks see each input
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        t = int(logits.argmax())
        toks.append(t)
        lps.append(float(torch.log_softmax(logits, -1)[t]))
        ids.append(t)
    return toks, lps


@pytest.mark.parametrize("key", list(FORMATS))
@pytest.mark.parametrize("ranges", [[(0, 3)], [(0, 2), (2, 3)]], ids=["P1", "P2"])
def test_format_matches_transformers_on_the_dequantized_weights(built, key, ranges):
    out, ref, qc = built(key)
    model = _reference(ref, qc)
    chain = stage_chain(out, ranges)
    assert all(type(s.layers[0].attn.qkv).__name__ in ("QuantLinear", "FP8Linear") for s in chain)
    with torch.inference_mode():
        for prompt, ours in zip(PROMPTS, chain_logits(chain, PROMPTS), strict=True):
            torch.testing.assert_close(ours, model(torch.tensor([prompt])).logits[0].float(), atol=TOL, rtol=TOL)
    toks, lps = chain_greedy(chain, PROMPTS, 5)
    for prompt, t, lp in zip(PROMPTS, toks, lps, strict=True):
        ref_t, ref_lp = _hf_greedy(model, prompt, 5)
        assert t == ref_t
        assert max(abs(a - b) for a, b in zip(lp, ref_lp, strict=True)) < TOL


def test_fp8_scales_are_applied(built, base):
    """The bug this fixes: FP8 weights read as plain weights with their scales ignored. The FP8
    stage must differ from the float model by fp8 rounding only, far less than unscaled weights would."""
    out, _, _ = built("ct-fp8-dynamic")
    fp8 = chain_logits(stage_chain(out, [(0, 3)]), PROMPTS[:1])[0]
    float_ = chain_logits(stage_chain(base, [(0, 3)]), PROMPTS[:1])[0]
    assert (fp8 - float_).abs().max() < 0.2 * float_.abs().max()


def test_a_stage_reads_only_its_packed_tensors(built):
    out, _, _ = built("gptq-int4-g32-sym")
    _, store = build_stage(out, 1, 2, False, False)
    assert store.loaded and all(n.startswith("model.layers.1.") for n in store.loaded)
    assert any(n.endswith(".qweight") for n in store.loaded)


@pytest.mark.parametrize("bits,group,act_order", [(4, 32, False), (4, 64, True), (8, 64, False), (8, 0, False)])
def test_kernels_agree_with_dequantize(bits, group, act_order):
    gen = torch.Generator().manual_seed(0)
    out_f, in_f = 96, 128
    groups = in_f // (group or in_f)
    g_idx = None
    if act_order:
        g_idx = (torch.arange(in_f) // group)[torch.randperm(in_f, generator=gen)].to(torch.int32)
    zeros = torch.full((out_f, groups), float(1 << (bits - 1))) if group == 0 else \
        torch.randint(0, 1 << bits, (out_f, groups), generator=gen).float()
    w = IntWeight(torch.randint(0, 1 << bits, (out_f, in_f), generator=gen, dtype=torch.uint8),
                  torch.rand(out_f, groups, generator=gen) / 50 + 1e-3, zeros, bits, group or in_f, g_idx)
    m = QuantLinear(in_f, out_f, False, bits, group)
    m.load(w)
    x = torch.randn(5, in_f, generator=gen)
    expect = x @ w.dequantize().t()
    ran = 0
    for kernel in ("dequantize", "int4pack", "int8pack"):
        try:
            m.set_kernel(kernel)
        except RuntimeError:
            continue
        torch.testing.assert_close(m(x), expect, atol=1e-4, rtol=1e-4)
        ran += 1
    assert ran >= 2 if (bits == 4 and group) or (bits == 8 and group == 0) else ran == 1
    chosen = choose_kernels(torch.nn.Sequential(m), torch.float32, (4, 16))
    assert chosen[f"{in_f}x{out_f}"]["kernel"] == m.kernel
    torch.testing.assert_close(m(x), expect, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qc,named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3 bits"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
    ({"quant_method": "gptq", "bits": 4, "some_new_switch": True}, "some_new_switch"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "gemv"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                            "group_size": 16}}}}, "nvfp4-pack-quantized"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "kv_cache_scheme": {"num_bits": 8},
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group",
                                                                  "group_size": 128}}}}, "kv_cache_scheme"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}}, "int-quantized"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "frozen",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                  "strategy": "channel"}}}}, "frozen"),
])
def test_unsupported_configs_are_refused_by_name(qc, named):
    with pytest.raises(UnsupportedQuantization, match=named):
        checkpoint_format({"quantization_config": qc})


def test_stage_memory_counts_packed_sizes(built, base):
    out, _, _ = built("gptq-int4-g32-sym")
    cfg, float_cfg = read_config(out), read_config(base)
    packed, first, last = model_costs(cfg, spec_from_config(cfg), None, torch.float32, 0)
    floats, f_first, f_last = model_costs(float_cfg, spec_from_config(float_cfg), None, torch.float32, 0)
    assert (first, last) == (f_first, f_last)  # embeddings and head stay float
    spec = spec_from_config(cfg)
    proj = spec.hidden_size * (spec.q_dim + 2 * spec.kv_dim) + spec.q_dim * spec.hidden_size \
        + 3 * spec.hidden_size * spec.intermediate_size  # weights of one layer's projections
    for p, f in zip(packed, floats, strict=True):
        # float32 (4 bytes) -> half a byte a weight plus two float32 per group of 32
        assert p == f - 4 * proj + proj // 2 + proj // 32 * 8
