"""Attention over the cache in runs of consecutive rows (``sdpa.kv_runs``): each run reads its own
longest row's columns instead of every row reading the segment's longest. The split is chosen by
cost; here the call cost is set near zero so that tiny models split too, and the results must still
match HF (GQA, ALiBi, soft-capping with sliding windows, longrope) and the one-call path."""

import pytest
import torch

import torch.nn.functional as F

from pipeline.models import decoder

from pipeline.models.kernels import native, sdpa
from pipeline.models.decoder import Segment
from pipeline.models.kernels.sdpa import kv_runs
from tests.utils import assert_hf_parity, random_hf_model, stage_chain

CELL = 6144  # bytes of keys + values per cached position: 12 heads x 64 x 2 x float32
PROMPTS = [[5, 17, 300, 42, 9, 11, 1000, 7, 13], [100, 200], [31, 1020, 8, 99, 900],
           [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 383, 279, 502, 88, 41, 97, 169, 399, 37, 510, 58, 20]]
GQA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
FAMILIES = {
    "llama-gqa": ("llama", GQA),
    "bloom-alibi": ("bloom", dict(hidden_size=48, n_layer=3, n_head=6)),
    "gemma2-softcap-sliding": ("gemma2", dict(GQA, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                                              attn_logit_softcapping=0.05, final_logit_softcapping=0.5)),
    "phi3-longrope": ("phi3", dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                   max_position_embeddings=64, original_max_position_embeddings=16,
                                   rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                                                        short_factor=[1.0, 1.3, 1.7, 2.0, 2.5, 3.0],
                                                        long_factor=[1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
                                                        original_max_position_embeddings=16))),
}


def _cells(rows, ends, runs, cols):
    """Cells read (and calls made) by ``runs``, or by one call when None."""
    if runs is None:
        return len(rows) * cols, 1
    return sum((j - i) * n for i, j, n in runs), len(runs)


def test_equal_lengths_keep_one_call():
    assert kv_runs(list(range(32)), [600] * 32, 600, CELL, "cpu") is None
    assert kv_runs(list(range(32)), [590 + i % 11 for i in range(32)], 600, CELL, "cpu") is None


def test_short_rows_beside_long_ones_split_into_runs():
    rows, ends = list(range(8)), [600, 610, 40, 35, 50, 45, 580, 600]
    runs = kv_runs(rows, ends, 610, CELL, "cpu")
    assert runs == [(0, 2, 610), (2, 6, 50), (6, 8, 600)]
    cells, calls = _cells(rows, ends, runs, 610)
    assert cells < len(rows) * 610 and calls == 3


def test_runs_cover_every_row_with_its_columns():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        rows = sorted(torch.randperm(48, generator=gen)[:n].tolist())
        ends = torch.randint(1, 700, (n,), generator=gen).tolist()
        cols = max(ends)
        runs = kv_runs(rows, ends, cols, CELL, "cpu")
        if runs is None:
            continue
        assert [r[0] for r in runs] == [0] + [r[1] for r in runs[:-1]] and runs[-1][1] == n  # a partition
        for i, j, c in runs:
            assert rows[i:j] == list(range(rows[i], rows[i] + j - i))  # consecutive cache rows: a view
            assert c == max(ends[i:j])
        one = (1 if rows == list(range(rows[0], rows[0] + n)) else 3) * n * cols
        assert _cells(rows, ends, runs, cols)[0] < one  # reads less than the one call it replaces


def test_gpu_splits_only_for_large_savings():
    rows, ends = list(range(8)), [600, 610, 40, 35, 50, 45, 580, 600]
    assert kv_runs(rows, ends, 610, CELL, "cuda") is None  # ~2000 cells saved: less than a launch
    assert kv_runs(list(range(64)), [8000] * 8 + [100] * 56, 8000, CELL, "cuda") == [(0, 8, 8000), (8, 64, 100)]


@pytest.fixture
def always_split(monkeypatch):
    """Calls cost ~nothing: every segment with differing lengths splits (decode steps in runs, as on a
    GPU, not through the CPU's native decode kernel). Returns the runs chosen."""
    monkeypatch.setattr(native, "decode_dtypes", lambda: ())
    monkeypatch.setitem(sdpa.CALL_BYTES, "cpu", 1)
    seen = []

    def spy(*args):
        runs = kv_runs(*args)
        seen.append(runs)
        return runs

    monkeypatch.setattr(decoder, "kv_runs", spy)
    return seen


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_runs_match_hf(name, tmp_path, always_split):
    model_type, overrides = FAMILIES[name]
    path = random_hf_model(tmp_path, model_type, **overrides)
    assert_hf_parity(path, PROMPTS, stages=2)
    assert any(runs and len(runs) > 1 for runs in always_split)  # the decode steps really split


@torch.inference_mode()
def test_runs_over_scattered_rows_match_one_gathered_call(tmp_path, monkeypatch, always_split):
    """Decoding rows 0, 2, 3, 5 of a 6-row cache (1 and 4 idle): runs of views against the one call
    that gathers the rows first."""
    path = random_hf_model(tmp_path, "llama", **GQA)
    (stage,) = stage_chain(path, [(0, 3)])
    lens = [9, 2, 30, 5, 12, 25]
    cache = stage.new_cache(6, 40)
    t = max(lens)
    ids = torch.randint(3, 1000, (6, t), generator=torch.Generator().manual_seed(1))
    stage(ids, Segment(torch.arange(6), torch.zeros(6, dtype=torch.long), t, t, all_rows=True, fresh=True,
                       prefill=True, lens=lens), cache)
    rows = [0, 2, 3, 5]
    starts = [lens[r] for r in rows]

    def step():
        seg = Segment(torch.tensor(rows), torch.tensor(starts), 1, max(starts) + 1, host_rows=rows,
                      host_start=starts, lens=[1] * len(rows))
        return stage(torch.tensor([[7], [8], [9], [10]]), seg, cache)

    split = step()
    assert always_split[-1] == [(0, 1, 10), (1, 2, 31), (2, 3, 6), (3, 4, 26)]
    monkeypatch.setattr(decoder, "kv_runs", lambda *args: None)
    torch.testing.assert_close(split, step(), atol=1e-5, rtol=1e-5)


needs_native = pytest.mark.skipif(native.library() is None, reason="no C compiler: decode attention runs in runs")


def _per_row_reference(q, k, v, rows, ends, window, scale):
    """Each row alone: SDPA over exactly its own columns, in float32."""
    g = q.shape[1] // k.shape[1]
    out = []
    for i, (r, e) in enumerate(zip(rows.tolist(), ends.tolist(), strict=True)):
        f = max(0, e - window) if window else 0
        kk, vv = k[r, :, f:e].float().repeat_interleave(g, 0), v[r, :, f:e].float().repeat_interleave(g, 0)
        out.append(F.scaled_dot_product_attention(q[i : i + 1].float(), kk[None], vv[None], scale=scale))
    return torch.cat(out)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d,window", [(4, 4, 16, 0), (8, 2, 64, 0), (6, 3, 40, 5)])
def test_native_decode_attention_matches_each_row_alone(dtype, heads, kv_heads, d, window):
    """The CPU decode kernel: one query per row against its own cache row's columns (GQA, a sliding
    window, rows out of order, a row of one column, q as the strided view the layers pass)."""
    g = torch.Generator().manual_seed(heads * d + window)
    k, v = (torch.randn(7, kv_heads, 50, d, generator=g).to(dtype) for _ in range(2))
    rows, ends = torch.tensor([5, 0, 3, 6, 1]), torch.tensor([50, 1, 17, 9, 33])
    q = torch.randn(5, 1, heads, d, generator=g).to(dtype).transpose(1, 2)  # (b, h, 1, d), not contiguous
    got = native.decode_attention(q, k, v, rows, ends, window, d**-0.5)
    assert got.shape == (5, heads, 1, d) and got.dtype == dtype
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)  # bf16: output rounding
    torch.testing.assert_close(got.float(), _per_row_reference(q, k, v, rows, ends, window, d**-0.5), **tol)


@pytest.fixture
def native_decode(monkeypatch):
    """Counts the layers' calls of the native decode kernel."""
    calls = []
    real = native.decode_attention

    def spy(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(native, "decode_attention", spy)
    return calls


@needs_native
@pytest.mark.parametrize("name", ["llama-gqa", "phi3-longrope", "mistral-sliding", "gemma3-sliding"])
def test_native_decode_matches_hf(name, tmp_path, native_decode):
    """float32 CPU stages decode through the native kernel, and the tokens and logprobs are HF's."""
    model_type, overrides = {**FAMILIES, **SLIDING}[name]
    path = random_hf_model(tmp_path, model_type, **overrides)
    assert_hf_parity(path, PROMPTS, stages=2)
    assert native_decode  # the decode steps really went through it


SLIDING = {"mistral-sliding": ("mistral", dict(GQA, sliding_window=4)),
           "gemma3-sliding": ("gemma3_text", dict(GQA, head_dim=16, sliding_window=4, query_pre_attn_scalar=20,
                                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"]))}


@pytest.mark.parametrize("name", [*FAMILIES, *SLIDING])
def test_fresh_prompts_attend_row_by_row_and_match_hf(name, tmp_path, monkeypatch):
    """Unpadded fresh prompts of mixed lengths attend one row at a time over the row's own tokens:
    causal layers (llama, phi3), sliding layers with their window's mask where the window cuts a row
    (mistral, gemma3: windows of 4 against prompts of 2..25), soft-capped scores with each row's
    causal mask (gemma2), ALiBi with each row's biases (bloom). All match HF."""
    calls = []
    rows = decoder.Attention._prompt_rows

    def spy(self, qkv, ctx, layer):
        calls.append(len(ctx.spans))
        return rows(self, qkv, ctx, layer)

    monkeypatch.setattr(decoder.Attention, "_prompt_rows", spy)
    model_type, overrides = {**FAMILIES, **SLIDING}[name]
    assert_hf_parity(random_hf_model(tmp_path, model_type, **overrides), PROMPTS, stages=2)
    assert len(PROMPTS) in calls  # the four prompts' prefill went row by row


def test_row_layout_masks_each_row_within_its_window():
    """A row resuming at position 6 with 3 new tokens, window 4: it reads cache columns 3..8, query
    p seeing (p - 4, p]; a row of 3 tokens is not cut by the window and shares full attention's
    layout; fresh rows within the window need no mask (the kernel's causal masking)."""
    from pipeline.models.kernels.unpad import row_layout

    resumed = Segment(torch.arange(2), torch.tensor([6, 0]), 3, 9, fresh=False, prefill=True, lens=[3, 3])
    real = torch.tensor([0, 1, 2, 3, 4, 5])
    spans, cells, row_keys = row_layout(resumed, real, torch.arange(9), [0, 4])
    assert spans == [(0, 3), (3, 6)]
    assert cells[1].tolist() == [6, 7, 8, 0, 1, 2]
    (r0, end0, views0), (r1, end1, views1) = row_keys
    assert (r0, end0, r1, end1) == (0, 9, 1, 3)
    first, mask = views0[4]
    assert first == 3 and mask[0, 0].int().tolist() == [[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    first, mask = views0[0]
    assert first == 0 and mask.shape == (1, 1, 3, 9) and mask[0, 0, 0].int().tolist() == [1] * 7 + [0, 0]
    assert views1[4] is views1[0] and views1[0][1][0, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    fresh = Segment(torch.arange(2), torch.zeros(2, dtype=torch.long), 6, 6, fresh=True, prefill=True, lens=[6, 3])
    _, _, ((_, _, long), (_, _, short)) = row_layout(fresh, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8]),
                                                     torch.arange(6), [0, 4])
    assert long[0] == (0, None) and short[0] == short[4] == (0, None)
    assert long[4][1][0, 0].int().tolist()[5] == [0, 0, 1, 1, 1, 1]  # position 5 sees 2..5


RESUMING = {"llama": ("mistral", dict(GQA, sliding_window=None)),
            "sliding-6": ("mistral", dict(GQA, sliding_window=6)),
            "gemma2-softcap-sliding": FAMILIES["gemma2-softcap-sliding"],
            "bloom-alibi": FAMILIES["bloom-alibi"]}


@pytest.mark.parametrize("name", sorted(RESUMING))
@torch.inference_mode()
def test_prompts_resuming_after_cached_tokens_attend_row_by_row(name, tmp_path, monkeypatch):
    """A prefill in two chunks (the second resuming after the first's cached tokens, rows of mixed
    lengths) gives the one-chunk prefill's hidden states, the second chunk's rows attending one by
    one over their cache rows (masked; with a sliding window of 6, from the first column each row's
    first query sees; with ALiBi, its biases; with soft-capping, after the cap)."""
    model_type, overrides = RESUMING[name]
    path = random_hf_model(tmp_path, model_type, **overrides)
    (stage,) = stage_chain(path, [(0, 3)])
    lens, first = [9, 30, 5, 17], [4, 12, 5, 0]  # tokens per row; of which the first chunk computes
    ids = torch.randint(3, 1000, (4, 30), generator=torch.Generator().manual_seed(2))

    def prefill(cache, starts, stops):
        t = max(b - a for a, b in zip(starts, stops, strict=True))
        chunk = torch.stack([torch.cat([ids[i, a:b], ids.new_zeros(t - (b - a))]) for i, (a, b) in enumerate(zip(starts, stops, strict=True))])
        fresh = not any(starts)
        seg = Segment(torch.arange(4), torch.tensor(starts), t, t if fresh else max(starts) + t, fresh=fresh,
                      prefill=True, host_rows=list(range(4)), host_start=starts, lens=[b - a for a, b in zip(starts, stops, strict=True)])
        return stage(chunk, seg, cache)

    whole = prefill(stage.new_cache(4, 32), [0] * 4, lens)
    calls = []
    rows = decoder.Attention._prompt_rows
    monkeypatch.setattr(decoder.Attention, "_prompt_rows", lambda self, *a: calls.append(1) or rows(self, *a))
    cache = stage.new_cache(4, 32)
    prefill(cache, [0] * 4, first)
    second = prefill(cache, first, lens)
    assert len(calls) == 2 * 3  # both chunks, every layer
    for i, (a, b) in enumerate(zip(first, lens, strict=True)):
        torch.testing.assert_close(second[i, : b - a], whole[i, a:b], atol=1e-5, rtol=1e-5)


def _varlen_reference(seen):
    """``torch.nn.attention.varlen.varlen_attn`` as documented, on the CPU (its kernel is CUDA-only):
    sequence i's queries ``cu_q[i]:cu_q[i+1]`` attend its keys ``cu_k[i]:cu_k[i+1]``, query j seeing
    key i when j - left <= i <= j + right (``window_size``; -1: unbounded), GQA by head groups."""
    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        seen.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k, window_size, enable_gqa))
        assert cu_q.dtype == torch.int32 and (k.shape[1] == q.shape[1]) != enable_gqa
        outs = []
        for a, b, c, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist(), strict=True):
            qi, ki, vi = q[a:b].transpose(0, 1), k[c:e].transpose(0, 1), v[c:e].transpose(0, 1)
            ki, vi = (x.repeat_interleave(q.shape[1] // k.shape[1], 0) for x in (ki, vi))
            j, i = torch.arange(b - a)[:, None] + (e - c) - (b - a), torch.arange(e - c)[None]
            left, right = window_size
            mask = ((i >= j - left) if left >= 0 else True) & ((i <= j + right) if right >= 0 else True)
            outs.append(torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
                        .transpose(0, 1))
        return torch.cat(outs)
    return varlen


PACKED = {"llama-gqa": (FAMILIES["llama-gqa"], {(-1, 0)}), "mistral-sliding": (SLIDING["mistral-sliding"], {(3, 0)}),
          "gemma3-sliding": (SLIDING["gemma3-sliding"], {(3, 0), (-1, 0)}),  # sliding and full layers
          "gemma2-softcap-sliding": (FAMILIES["gemma2-softcap-sliding"], None),  # soft-capped: row by row
          "bloom-alibi": (FAMILIES["bloom-alibi"], None)}  # ALiBi biases: row by row


@pytest.mark.parametrize("name", sorted(PACKED))
def test_fresh_prompts_on_a_gpu_attend_in_one_packed_call(name, tmp_path, monkeypatch):
    """On a GPU, a prefill of fresh prompts attends through PyTorch's variable-length FlashAttention,
    once per layer over the packed real tokens (here its documented semantics on the CPU, forced in):
    the rows' cumulative offsets, causal, a window of 4 as (3, 0) (keys (p - 4, p]), GQA without
    repeating K/V, and HF's logits and greedy tokens. ALiBi and soft-capped models keep attending row
    by row; so does every model on the CPU."""
    from pipeline.models.kernels import unpad

    assert unpad.packed_kernel(torch.device("cpu"), torch.bfloat16, 64) is None
    seen = []
    monkeypatch.setattr(unpad, "packed_kernel", lambda device, dtype, head_dim: _varlen_reference(seen))
    (model_type, overrides), windows = PACKED[name]
    assert_hf_parity(random_hf_model(tmp_path, model_type, **overrides), PROMPTS, stages=2)
    if windows is None:
        assert seen == []
        return
    offsets = [0, 9, 11, 16, 41]  # the four prompts' real tokens, packed
    assert (offsets, offsets, 25, 25, (-1, 0) if name == "llama-gqa" else (3, 0), True) in seen
    assert {s[4] for s in seen} == windows and all(s[5] for s in seen)  # GQA: 4 query heads, 2 K/V heads


def _cuda_flash() -> bool:
    from pipeline.models.kernels import unpad

    return torch.cuda.is_available() and unpad.packed_kernel(torch.device("cuda"), torch.bfloat16, 16) is not None


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-sliding"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not _cuda_flash(), reason="needs a CUDA GPU with FlashAttention (the packed kernel's only device)"))])
@torch.inference_mode()
def test_packed_prefill_equals_row_by_row(name, device, tmp_path, monkeypatch):
    """The packed call and the row-by-row loop give the same hidden states for a ragged prefill: on a
    GPU with the real variable-length kernel in bfloat16 (the first GPU run checks it), on the CPU
    with its documented semantics in float32."""
    from pipeline.loading.stage_weights import build_stage
    from pipeline.models.kernels import unpad

    model_type, overrides = {**FAMILIES, **SLIDING}[name]
    gpu = device == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    real = unpad.packed_kernel(torch.device(device), dtype, 16)
    kernel = real if gpu else _varlen_reference([])
    stage = build_stage(random_hf_model(tmp_path, model_type, **overrides), 0, 3, True, True, dtype, device)[0]
    dev, b, t = torch.device(device), len(PROMPTS), max(map(len, PROMPTS))
    ids = torch.zeros(b, t, dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = torch.tensor(p)
    seg = Segment(torch.arange(b, device=dev), torch.zeros(b, dtype=torch.long, device=dev), t, t, all_rows=True,
                  fresh=True, prefill=True, host_rows=list(range(b)), host_start=[0] * b, lens=[len(p) for p in PROMPTS])
    calls = []
    monkeypatch.setattr(unpad, "packed_kernel", lambda *a: lambda *args, **kw: calls.append(1) or kernel(*args, **kw))
    packed = stage(ids.to(dev), seg, stage.new_cache(b, t))
    assert len(calls) == 3  # one call per layer
    monkeypatch.setattr(unpad, "packed_kernel", lambda *a: None)
    rows = stage(ids.to(dev), seg, stage.new_cache(b, t))
    tol = 3e-2 if gpu else 1e-5
    for i, p in enumerate(PROMPTS):
        torch.testing.assert_close(packed[i, : len(p)].float(), rows[i, : len(p)].float(), atol=tol, rtol=tol)


def test_packed_kernel_without_enable_gqa_repeats_kv_heads():
    """torch 2.11's ``varlen_attn`` has no ``enable_gqa`` (2.13's has): the packed call then gets each
    K/V head repeated for its query heads and the same output as a kernel taking the flag."""
    from pipeline.models.kernels.unpad import with_gqa

    seen = []
    flagged = _varlen_reference(seen)

    def old(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):  # torch 2.11's signature
        return flagged(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)

    assert with_gqa(flagged) is flagged
    torch.manual_seed(0)
    q, k, v = torch.randn(11, 4, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    cu = torch.tensor([0, 7, 11], dtype=torch.int32)
    want = flagged(q, k, v, cu, cu, 7, 7, scale=0.3, window_size=(-1, 0), enable_gqa=True)
    got = with_gqa(old)(q, k, v, cu, cu, 7, 7, scale=0.3, window_size=(-1, 0), enable_gqa=True)
    torch.testing.assert_close(got, want)
    assert seen[-1][5] is False  # the old kernel got equal heads, no flag
