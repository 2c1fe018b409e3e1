"""``--cpu-linear``: CPU stages multiply against oneDNN's prepacked weights (pipeline/models/kernels/packed.py).

The packed product is the plain one up to float rounding (a different summation order), so a run
with it agrees with ``--cpu-linear plain`` and with HF as far as rounding lets two kernels agree
(the rules of ``tests.utils.assert_consistent_results``). HF parity of every family runs through
``tests.utils.stage_chain``, which packs exactly as the runner does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.decoder import StageModel
from pipeline.models.kernels.packed import NativeBf16Linear, PackedLinear, native_bf16, pack_stage, why_not
from tests.utils import (
    DATA,
    assert_consistent_results,
    chain_logits,
    hf_logits,
    read_jsonl,
    run_inprocess,
    stage_chain,
)

PACKS = why_not(torch.device("cpu"), torch.float32, False, "none") is None
needs_onednn = pytest.mark.skipif(not PACKS, reason="this torch build has no usable oneDNN packed linear")


@needs_onednn
@pytest.mark.parametrize("shape,bias", [((64, 96), False), ((96, 64), True), ((128, 384), False), ((7, 5), True)])
def test_packed_product_is_the_linear_product(shape, bias):
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(*shape, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
    ref_w, ref_b = lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone()
    packed = PackedLinear(lin)
    for x in (torch.randn(1, shape[0], generator=gen), torch.randn(33, shape[0], generator=gen),
              torch.randn(3, 5, shape[0], generator=gen),  # (batch, time, in) as prefill passes it
              torch.randn(shape[0], 9, generator=gen).t(),  # a transposed (non-contiguous) view
              torch.randn(0, shape[0])):  # no rows (a stage's empty segment)
        with torch.inference_mode():
            y = packed(x)
        assert y.shape == (*x.shape[:-1], shape[1])
        torch.testing.assert_close(y, F.linear(x, ref_w, ref_b), atol=1e-4, rtol=1e-5)


def test_which_stages_keep_the_plain_product():
    cpu = torch.device("cpu")
    assert "CPU" in why_not(torch.device("cuda", 0), torch.float32, False, "none")
    assert "float16" in why_not(cpu, torch.float16, False, "none")
    bf16 = why_not(cpu, torch.bfloat16, False, "none")  # packs only where the CPU has bf16 instructions
    assert (bf16 is None) if native_bf16() and PACKS else ("bfloat16" in bf16 or "oneDNN" in bf16)
    assert "--quantize int8" in why_not(cpu, torch.float32, False, "int8")
    assert "--batch-invariant" in why_not(cpu, torch.float32, True, "none")


@pytest.fixture
def any_head(monkeypatch):
    """A tiny model's head is most of its weights: let it pack whatever its share."""
    from pipeline.models.kernels import packed

    monkeypatch.setattr(packed, "HEAD_SHARE", 1.0)


@needs_onednn
def test_packed_stage_swaps_the_layer_projections_and_a_head_of_its_own(any_head, llama_2l):
    plain = stage_chain(llama_2l, [(0, 2)], cpu_linear="plain")[0]
    stage = stage_chain(llama_2l, [(0, 2)], cpu_linear="plain")[0]
    n, reason = pack_stage(stage, torch.device("cpu"), torch.float32)
    assert (n, reason) == (8, None) and stage.cpu_linear == "onednn"  # qkv, o, up, down x 2 layers
    for layer in stage.layers:
        for lin in (layer.attn.qkv, layer.attn.o, layer.mlp.up, layer.mlp.down):
            assert isinstance(lin, PackedLinear)
    assert isinstance(stage, StageModel) and isinstance(stage.lm_head, PackedLinear)  # untied: its own table
    assert type(stage.embed) is nn.Embedding
    names = {n for n, _ in stage.named_parameters()}  # the projections' weights are packed copies now
    assert not any(n.endswith(("qkv.weight", "o.weight", "up.weight", "down.weight", "lm_head.weight")) for n in names)
    assert pack_stage(plain, torch.device("cpu"), torch.float32, batch_invariant=True) == (
        0, "--batch-invariant keeps one kernel") and plain.cpu_linear == "plain"
    assert type(plain.lm_head) is nn.Linear


@needs_onednn
def test_a_tied_head_stays_the_embedding_table_and_int8_packs_only_its_float32_head(any_head, make_llama):
    """A stage holding both ends of a tied model keeps one table (the embedding reads its rows); a tied model's
    last stage holds a copy of its own, which packs. Under --quantize int8 the layers keep their int8 kernels
    and the float32 head packs; bfloat16 heads keep their own loop (kernels.logits)."""
    tied = make_llama(num_hidden_layers=2, tie_word_embeddings=True)
    whole = stage_chain(tied, [(0, 2)], cpu_linear="plain")[0]
    pack_stage(whole, torch.device("cpu"), torch.float32)
    assert type(whole.lm_head) is nn.Linear and whole.lm_head.weight is whole.embed.weight
    last = stage_chain(tied, [(0, 1), (1, 2)], cpu_linear="plain")[1]
    pack_stage(last, torch.device("cpu"), torch.float32)
    assert isinstance(last.lm_head, PackedLinear)
    q = stage_chain(tied, [(0, 1), (1, 2)], cpu_linear="plain")[1]
    assert pack_stage(q, torch.device("cpu"), torch.float32, quantize="int8") == (
        0, "--quantize int8 has its own kernels") and isinstance(q.lm_head, PackedLinear)
    half = stage_chain(tied, [(0, 1), (1, 2)], dtype=torch.bfloat16, cpu_linear="plain")[1]
    pack_stage(half, torch.device("cpu"), torch.bfloat16)
    assert type(half.lm_head) is nn.Linear


@needs_onednn
def test_a_head_too_large_a_share_of_its_stage_keeps_its_one_copy(llama_2l, monkeypatch):
    """The head packs only if it is at most HEAD_SHARE of the stage's weights (its plain and packed copies
    exist at once while it packs: the stage's peak); the layers pack either way."""
    from pipeline.models.kernels import packed

    stage = stage_chain(llama_2l, [(0, 2)], cpu_linear="plain")[0]
    share = stage.lm_head.weight.nbytes / sum(t.nbytes for t in (*stage.parameters(), *stage.buffers()))
    monkeypatch.setattr(packed, "HEAD_SHARE", share * 0.99)
    assert pack_stage(stage, torch.device("cpu"), torch.float32) == (8, None)
    assert type(stage.lm_head) is nn.Linear and isinstance(stage.layers[0].mlp.up, PackedLinear)
    again = stage_chain(llama_2l, [(0, 2)], cpu_linear="plain")[0]
    monkeypatch.setattr(packed, "HEAD_SHARE", share * 1.01)
    pack_stage(again, torch.device("cpu"), torch.float32)
    assert isinstance(again.lm_head, PackedLinear)


@needs_onednn
@pytest.mark.parametrize("ranges", [[(0, 2)], [(0, 1), (1, 2)]])
def test_packed_chain_matches_hf(llama_2l, ranges):
    prompts = [[1, 5, 9, 33, 2, 8], [1, 70, 71], [1, *range(40, 80)]]
    chain = stage_chain(llama_2l, ranges)
    assert all(st.cpu_linear == "onednn" for st in chain)
    for prompt, ours in zip(prompts, chain_logits(chain, prompts), strict=True):
        torch.testing.assert_close(ours, hf_logits(llama_2l, prompt), atol=1e-4, rtol=1e-4)


def test_plain_and_onednn_runs_agree(llama_2l, tmp_path):
    """The shared mixed-parameter file (greedy, sampled with seeds, echo logprobs) both ways."""
    data, out = str(DATA / "mixed_params.jsonl"), {}
    for kernel in ("plain", "onednn"):
        path = tmp_path / f"{kernel}.jsonl"
        assert run_inprocess(["--model-name", llama_2l, "--infer-data", data, "--output-path", str(path),
                              "--no-progress", "--num-threads", "1", "--cpu-linear", kernel]) == 0
        summary = json.loads(Path(f"{path}.summary.json").read_text())
        out[kernel] = read_jsonl(path)
        want = "onednn" if kernel == "onednn" and PACKS else "plain"
        assert [s.get("linear") for s in summary["stage_precision"]] == [want]
    assert_consistent_results(out["plain"], out["onednn"])


@pytest.mark.skipif(not (PACKS and native_bf16()), reason="packs bfloat16 only on CPUs with avx512_bf16 or AMX")
def test_packed_bfloat16_stage_matches_the_plain_one(llama_2l):
    """A bf16 stage packs its projections on a CPU with bf16 instructions, and computes what the plain
    bf16 stage does (oneDNN runs the plain bf16 product too: only the weight layout differs)."""
    prompts = [[1, 5, 9, 33, 2, 8], [1, *range(40, 80)]]
    plain = stage_chain(llama_2l, [(0, 1), (1, 2)], dtype=torch.bfloat16, cpu_linear="plain")
    packed = stage_chain(llama_2l, [(0, 1), (1, 2)], dtype=torch.bfloat16)
    assert all(st.cpu_linear == "onednn" and isinstance(st.layers[0].mlp.up, PackedLinear) for st in packed)
    assert packed[0].layers[0].mlp.up.weight.dtype == torch.bfloat16
    for ours, ref in zip(chain_logits(packed, prompts), chain_logits(plain, prompts), strict=True):
        torch.testing.assert_close(ours, ref, atol=2e-2, rtol=2e-2)  # bf16's rounding, whichever kernel


def test_packing_hands_each_freed_weight_back_before_the_next(llama_2l):
    """pack_stage calls ``release`` once per packed projection (the runner's: malloc_trim, so a plain
    weight's freed pages are not resident while the next packed copy is made)."""
    from pipeline.models.kernels.packed import pack_stage, why_not

    if why_not(torch.device("cpu"), torch.float32, False, "none") is not None:
        pytest.skip("no oneDNN packing here")
    stage = stage_chain(llama_2l, [(0, 2)], cpu_linear="plain")[0]
    calls = []
    n, reason = pack_stage(stage, torch.device("cpu"), torch.float32, release=lambda: calls.append(1))
    assert reason is None and n == 4 * 2 and len(calls) == n


@pytest.mark.parametrize("shape,bias", [((64, 96), False), ((96, 64), True), ((32, 7), True)])
def test_the_avx2_bf16_linear_is_the_float32_product_rounded_once(avx2_loops, shape, bias):
    """Without bf16 instructions a bfloat16 projection runs the C loop on its own weight (no copy): the
    float32 sum of the exact products, the bias added, then one rounding to bfloat16."""
    gen = torch.Generator().manual_seed(shape[0])
    lin = nn.Linear(*shape, bias=bias).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
    native = NativeBf16Linear(lin)
    assert native.weight.data_ptr() == lin.weight.data_ptr()
    for x in (torch.randn(1, shape[0], generator=gen), torch.randn(3, 5, shape[0], generator=gen),
              torch.randn(shape[0], 9, generator=gen).t(), torch.randn(0, shape[0])):
        x = x.bfloat16()
        with torch.inference_mode():
            y = native(x)
        want = (x.double() @ lin.weight.double().t() + (0 if lin.bias is None else lin.bias.double())).float()
        assert y.dtype == torch.bfloat16 and y.shape == (*x.shape[:-1], shape[1])
        torch.testing.assert_close(y.float(), want, atol=1e-5, rtol=2 ** -8)  # one bf16 rounding at most


def test_a_bfloat16_stage_without_bf16_instructions_takes_the_avx2_loop(avx2_loops, llama_2l, tmp_path):
    """The stage's projections (their widths a multiple of 32) become NativeBf16Linear over the loaded
    weights; logits agree with the plain bf16 stage within bf16's rounding, at P = 1 and 2; a whole run
    says "native" in its summary and agrees with --cpu-linear plain."""
    cpu = torch.device("cpu")
    assert why_not(cpu, torch.bfloat16, False, "none") is None
    prompts = [[1, 5, 9, 33, 2, 8], [1, *range(40, 80)]]
    for ranges in ([(0, 2)], [(0, 1), (1, 2)]):
        plain = stage_chain(llama_2l, ranges, dtype=torch.bfloat16, cpu_linear="plain")
        fast = stage_chain(llama_2l, ranges, dtype=torch.bfloat16)
        assert all(st.cpu_linear == "native" and isinstance(st.layers[0].mlp.up, NativeBf16Linear) for st in fast)
        for ours, ref in zip(chain_logits(fast, prompts), chain_logits(plain, prompts), strict=True):
            torch.testing.assert_close(ours, ref, atol=2e-2, rtol=2e-2)
    data, out = str(DATA / "mixed_params.jsonl"), {}
    for kernel in ("plain", "onednn"):
        path = tmp_path / f"{kernel}.jsonl"
        assert run_inprocess(["--model-name", llama_2l, "--infer-data", data, "--output-path", str(path),
                              "--no-progress", "--num-threads", "1", "--dtype", "bfloat16", "--cpu-linear", kernel]) == 0
        summary = json.loads(Path(f"{path}.summary.json").read_text())
        assert [s.get("linear") for s in summary["stage_precision"]] == ["native" if kernel == "onednn" else "plain"]
        out[kernel] = read_jsonl(path)
    echoed = 0
    for a, b in zip(out["plain"], out["onednn"], strict=True):  # bf16 runs: the same rows, scores within its rounding
        assert a["request"] == b["request"] and ("result" in a) == ("result" in b)
        if "result" in a and a["request"].get("echo") and a["request"].get("logprobs") is not None:
            pa, pb = (r["result"]["choices"][0]["logprobs"]["token_logprobs"] for r in (a, b))
            n = a["result"]["usage"]["prompt_tokens"]
            assert pa[0] is None and pb[0] is None
            torch.testing.assert_close(torch.tensor(pa[1:n]), torch.tensor(pb[1:n]), atol=0.1, rtol=0.05)
            echoed += 1
    assert echoed
