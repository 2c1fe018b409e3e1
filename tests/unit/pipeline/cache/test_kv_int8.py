"""--kv-cache-dtype int8: the records (int8 values + float32 scale per token and head), the native
store and decode kernel against their PyTorch forms, stages decoding over an int8 cache against the
same stages over a float cache (HF parity is the float cache's, in test_attention_runs), and the
options refused before loading. The runner's end-to-end runs are in test_quantize (P = 1 and 2)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline.models.kernels import native
from pipeline.models.decoder import Segment
from pipeline.cache.kv_cache import KVCache, dequantize_records, quantize_records
from pipeline.config.options import RunOptions, UsageError, check_options
from pipeline.config.plan import make_plan
from tests.unit.pipeline.models.test_attention_runs import _per_row_reference
from tests.utils import random_hf_model, stage_chain

needs_native = pytest.mark.skipif(native.library() is None, reason="no C compiler: the PyTorch forms run instead")
GQA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
PROMPTS = [[5, 17, 300, 42, 9, 11, 1000, 7, 13], [100, 200], [31, 1020, 8, 99, 900],
           [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 383, 279, 502, 88, 41, 97, 169, 399, 37, 510, 58, 20]]
ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}


def test_records_hold_values_within_half_a_step_and_their_scale():
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-3, 1.0, 300.0])[:, None, None]
    x[1, 2] = 0  # an all-zero head: zeros, scale 0, no NaN
    rec = quantize_records(x)
    assert rec.dtype == torch.int8 and rec.shape == (3, 5, 68)
    scale = rec[..., 64:].contiguous().view(torch.float32)  # the last four bytes: the float32 scale
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 127)
    assert rec[..., :64].abs().amax(-1)[scale[..., 0] > 0].eq(127).all()  # each head's largest value is +-127
    back = dequantize_records(rec, torch.float32)
    assert ((back - x).abs() <= scale * 0.5 * (1 + 1e-5)).all() and back[1, 2].eq(0).all()
    assert dequantize_records(rec, torch.bfloat16).dtype == torch.bfloat16


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_store_writes_the_records_bit_for_bit(dtype):
    """The C store quantizes exactly as :func:`quantize_records` and writes each token at its own cache
    row and column (scattered rows, a strided input as the layers pass it)."""
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(6, 3 * 2 * 64, generator=g) * 4).to(dtype)
    k = qkv[:, 128:256].view(6, 2, 64)  # a view into the fused projection: row stride 384
    rows, cols = torch.tensor([3, 0, 0, 2, 3, 1]), torch.tensor([0, 7, 2, 9, 1, 4])
    cache = torch.zeros(4, 2, 10, 68, dtype=torch.int8)
    native.kv_store_i8(k, cache, rows, cols)
    want = torch.zeros_like(cache)
    want[rows, :, cols] = quantize_records(k)
    assert torch.equal(cache, want)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d,window", [(4, 4, 16, 0), (8, 2, 64, 0), (6, 3, 40, 5)])
def test_native_decode_over_records_matches_each_row_alone(dtype, heads, kv_heads, d, window):
    """Decode attention reading int8 records (vector path at d % 16 == 0, the plain loop at d = 40):
    each row against its own dequantized columns, GQA, a window, rows out of order, one column."""
    g = torch.Generator().manual_seed(heads * d + window)
    k, v = (quantize_records(torch.randn(7, kv_heads, 50, d, generator=g) * 3) for _ in range(2))
    rows, ends = torch.tensor([5, 0, 3, 6, 1]), torch.tensor([50, 1, 17, 9, 33])
    q = torch.randn(5, 1, heads, d, generator=g).to(dtype).transpose(1, 2)
    got = native.decode_attention(q, k, v, rows, ends, window, d**-0.5)
    assert got.shape == (5, heads, 1, d) and got.dtype == dtype
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)  # bf16: output rounding
    k, v = dequantize_records(k, torch.float32), dequantize_records(v, torch.float32)  # each row alone over these
    torch.testing.assert_close(got.float(), _per_row_reference(q, k, v, rows, ends, window, d**-0.5), **tol)


def _decode_logprobs(chain, prompts, tokens):
    """Prefill ``prompts`` (fresh, unpadded), then feed ``tokens`` (the same for every cache kind: the
    float cache's greedy choices) one step at a time: log-softmax of every step, (steps, b, vocab)."""
    b, t = len(prompts), max(map(len, prompts))
    caches = [st.new_cache(b, t + len(tokens) + 1) for st in chain]
    ids = torch.zeros(b, t, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    seg = Segment(torch.arange(b), torch.zeros(b, dtype=torch.long), t, t, all_rows=True, fresh=True, prefill=True,
                  lens=lens.tolist())
    x = ids
    with torch.inference_mode():
        for st, c in zip(chain, caches, strict=True):
            x = st(x, seg, c)
        out = [torch.log_softmax(chain[-1].head(x[torch.arange(b), lens - 1]), -1)]
        for step, tok in enumerate(tokens):
            seg = Segment(torch.arange(b), lens + step, 1, int((lens + step).max()) + 1, all_rows=True)
            x = tok[:, None]
            for st, c in zip(chain, caches, strict=True):
                x = st(x, seg, c)
            out.append(torch.log_softmax(chain[-1].head(x[:, -1]), -1))
    return torch.stack(out)


@pytest.mark.parametrize("name,model_type,overrides", [
    ("llama-gqa", "llama", GQA),
    ("mistral-sliding", "mistral", dict(GQA, sliding_window=4)),
])
def test_stages_over_an_int8_cache_decode_as_over_a_float_cache(name, model_type, overrides, tmp_path, monkeypatch):
    """Two stages, mixed prompt lengths, 8 decode steps fed the float cache's greedy tokens: over an
    int8 cache every step's log-probabilities stay within the int8 rounding of keys and values of the
    float cache's (0.003 measured on these models; allowed 0.05), the prefill's are the same (prompts
    attend to their own keys before they are stored); the native kernel and PyTorch's dequantized
    path agree to float rounding."""
    path = random_hf_model(tmp_path, model_type, **overrides)
    chain = stage_chain(path, [(0, 2), (2, 3)])
    float_lp = _decode_logprobs(chain, PROMPTS, [])
    tokens = []
    for _ in range(8):  # the float cache's greedy run
        tokens.append(_decode_logprobs(chain, PROMPTS, tokens)[-1].argmax(-1))
    float_lp = _decode_logprobs(chain, PROMPTS, tokens)
    for st in chain:
        st.kv_int8 = True
    int8_lp = _decode_logprobs(chain, PROMPTS, tokens)
    torch.testing.assert_close(int8_lp[0], float_lp[0], atol=1e-5, rtol=1e-5)
    assert (int8_lp - float_lp).abs().max() < 0.05
    if native.library() is not None:  # the same int8 cache read by PyTorch (dequantized copies) instead
        monkeypatch.setattr(native, "library", lambda: None)
        torch.testing.assert_close(_decode_logprobs(chain, PROMPTS, tokens), int8_lp, atol=1e-4, rtol=1e-4)


def test_cache_store_without_the_library_writes_the_same_records(monkeypatch):
    """KVCache.store through the C loop and through PyTorch operators: the same bytes; read gives the
    values back within their rounding."""
    spec = SimpleNamespace(head_dim=16, num_kv_heads=2)  # the cache reads only the head sizes
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    rows, cols = torch.tensor([0, 1, 1, 2, 0]), torch.tensor([3, 0, 1, 5, 4])
    caches = []
    for lib in (native.library(), None):
        monkeypatch.setattr(native, "library", lambda lib=lib: lib)
        cache = KVCache(1, 3, 6, spec, torch.float32, "cpu", int8=True)
        cache.store(0, rows, cols, k, v)
        caches.append(cache)
        rk, rv = cache.read(0, slice(0, 1), slice(3, 5), torch.float32)
        torch.testing.assert_close(rk[0, :, 0], k[0], atol=0.05, rtol=0.02)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def test_refused_before_loading(tmp_path, monkeypatch):
    assert any("--kv-cache-dtype int8 needs a native family" in p
               for p in check_options(RunOptions(kv_cache_dtype="int8", backend="transformers")))
    generic = random_hf_model(tmp_path / "g", "llama", **GQA)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU node: the kernel is CPU-only
    with pytest.raises(UsageError, match="CPU stages only"):
        make_plan(RunOptions(model_name=generic, kv_cache_dtype="int8"), env=ENV, cpu_count=1)
    monkeypatch.undo()
    odd = random_hf_model(tmp_path / "o", "llama", hidden_size=72, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=96)  # head_dim 18
    with pytest.raises(UsageError, match="divisible by 4"):
        make_plan(RunOptions(model_name=odd, kv_cache_dtype="int8"), env=ENV, cpu_count=1)
    plan = make_plan(RunOptions(model_name=generic, kv_cache_dtype="int8"), env=ENV, cpu_count=1)
    assert plan.fingerprint["kv_cache_dtype"] == "int8" and plan.model_name.endswith(":kv-int8")


def test_batch_invariant_stages_over_an_int8_cache_repeat_a_row_exactly(tmp_path):
    """--batch-invariant with --kv-cache-dtype int8: quantization is per token and head, so a row's
    decode log-probabilities are the same bits alone as beside other rows (the invariant path reads
    the cache through dequantized copies)."""
    path = random_hf_model(tmp_path, "llama", **GQA)
    chain = stage_chain(path, [(0, 2), (2, 3)], batch_invariant=True)
    for st in chain:
        st.kv_int8 = True
    tokens = [torch.tensor([7, 8, 9, 10]) + step for step in range(4)]
    together = _decode_logprobs(chain, PROMPTS, tokens)
    alone = _decode_logprobs(chain, PROMPTS[2:3], [t[2:3] for t in tokens])
    assert torch.equal(together[:, 2], alone[:, 0])


def test_budget_and_stage_memory_count_int8_records(tmp_path):
    """A cached position costs 2 x layers x kv_heads x (head_dim + 4) bytes with an int8 cache, in
    --budget auto and in --stage-memory's plan alike (float32: 4 bytes a value)."""
    from pipeline.config.budget import kv_cell_bytes
    from pipeline.loading.stage_weights import read_config
    from pipeline.models.families import spec_from_config
    from pipeline.config.sizing import model_costs

    path = random_hf_model(tmp_path, "llama", **GQA)  # 3 layers, 2 KV heads of 16
    stage = stage_chain(path, [(0, 3)])[0]
    assert kv_cell_bytes(stage) == 2 * 3 * 2 * 16 * 4
    stage.kv_int8 = True
    assert kv_cell_bytes(stage) == 2 * 3 * 2 * (16 + 4)
    cfg = read_config(path)
    spec = spec_from_config(cfg)
    floats = model_costs(cfg, spec, None, torch.float32, 100)[0]
    int8s = model_costs(cfg, spec, None, torch.float32, 100, kv_int8=True)[0]
    assert [f - i for f, i in zip(floats, int8s, strict=True)] == [100 * 2 * 2 * (16 * 4 - 20)] * 3
