"""Prefill without padding: the new prompts of a pass are right-padded to the longest for attention's
(b, t) layout, but a layer's projections and MLP run on the real tokens only, and attention goes row by
row over each prompt's own keys (:func:`attend_by_row`), or on a GPU in one variable-length
FlashAttention call over the packed tokens (:func:`packed_layout`). Why and measurements:
docs/design/attention-and-cpu-kernels.md.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import TYPE_CHECKING, Callable

import torch

from pipeline.models.device import to_device

if TYPE_CHECKING:
    from pipeline.models.context import Segment, StageContext

UNPAD_ABOVE = 0.9  # a prefill with more real tokens than this share of b * t keeps its padding


def real_tokens(seg: "Segment") -> torch.Tensor | None:
    """Flat indices (into b * t) of a prefill segment's real tokens, or None when there is no right
    padding worth skipping."""
    if not seg.prefill or seg.lens is None or seg.t == 1:
        return None
    b, t = len(seg.lens), seg.t
    if sum(seg.lens) > UNPAD_ABOVE * b * t:
        return None
    lens = torch.tensor(seg.lens)
    flat = (torch.arange(t)[None, :] < lens[:, None]).flatten().nonzero().squeeze(1)
    return to_device(flat, seg.rows.device)


def packed_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> Callable | None:
    """PyTorch's variable-length FlashAttention (``torch.nn.attention.varlen.varlen_attn``: packed
    (tokens, heads, d) queries and keys, each sequence delimited by cumulative offsets; causal, a
    sliding window through ``window_size``, GQA without repeating K/V) where it runs: a CUDA GPU with
    FlashAttention (compute capability 8.0 or later), float16 or bfloat16, head dimensions a multiple
    of 8 up to 256. None elsewhere (it has no CPU kernel) or on a torch without it."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or head_dim > 256:
        return None
    return _flash_varlen(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _flash_varlen(index: int) -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    ok = torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(index) >= (8, 0)
    return with_gqa(varlen_attn) if ok else None


def with_gqa(varlen_attn: Callable) -> Callable:
    """``varlen_attn`` taking ``enable_gqa``: itself where it does (torch 2.13), else (torch 2.11, whose
    signature has no such flag) a call that repeats each K/V head for its query heads first, the
    form every version accepts (a prefill's K/V copied once per layer)."""
    if "enable_gqa" in inspect.signature(varlen_attn).parameters:
        return varlen_attn

    def repeating(q, k, v, *args, enable_gqa: bool = False, **kwargs):
        if enable_gqa and k.shape[1] != q.shape[1]:  # (n, kvh, d) -> (n, h, d), heads in groups
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        return varlen_attn(q, k, v, *args, **kwargs)

    return repeating


def packed_layout(seg: "Segment", device: torch.device, dtype: torch.dtype, head_dim: int, plain: bool):
    """``(kernel, offsets, longest)`` for :func:`attend_packed` when a prefill's rows are all fresh
    prompts (their keys are their own new tokens) and ``plain`` (causal attention, within a window:
    no ALiBi biases, no soft-capping) and :func:`packed_kernel` serves the device; else None.
    ``offsets``: int32 (rows + 1,) cumulative real tokens, on ``device`` (from host lists: no sync)."""
    kernel = packed_kernel(device, dtype, head_dim) if seg.fresh and plain else None
    if kernel is None:
        return None
    lens = [n for n in seg.host()[2] if n]  # a row with nothing new holds no packed tokens
    return kernel, to_device(list(itertools.accumulate(lens, initial=0)), device, torch.int32), max(lens)


def attend_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed, window: int, scale: float) -> torch.Tensor:
    """q (n, h, d), k / v (n, kvh, d) of fresh prompts' real tokens, row after row -> (n, h * d): one
    call, each row's queries over its own keys, causal (``window_size`` (-1, 0)); a sliding layer's
    query at p sees keys (p - window, p]: ``window_size`` (window - 1, 0), as HF passes FlashAttention."""
    kernel, offsets, longest = packed
    out = kernel(q, k, v, offsets, offsets, longest, longest, scale=scale,
                 window_size=(window - 1, 0) if window else (-1, 0), enable_gqa=q.shape[1] != k.shape[1])
    return out.flatten(1)


def row_layout(seg: "Segment", real: torch.Tensor, keys: torch.Tensor, windows: list[int], slopes=None,
               softcap: bool = False, dtype: torch.dtype = torch.float32):
    """For :func:`attend_by_row`, once per segment: each row's real tokens [first, stop) among the
    segment's n; each real token's (cache row, column); each row's (cache row, end of its keys, and
    per sliding window in ``windows`` (0: full attention) the first key column it reads and its mask
    (1, 1, len, keys), None for new tokens attending only each other causally). ``keys``: arange
    over the segment's key columns.

    A query at position p sees keys (p - window, p]; a row no longer than the window sees all its
    keys, as under full attention, so it shares that layout (no mask for a fresh prompt). A row
    resuming after cached tokens reads its cache row from the first column its first query sees.
    With ALiBi (``slopes``, (heads,)) every mask is additive, (1, heads, len, keys): the head's slope
    times the key's position where the query sees it, -inf elsewhere; with ``softcap`` (soft-capped
    scores: not the kernel's causal flag) fresh rows get their causal mask too."""
    ends = list(itertools.accumulate(seg.lens))
    spans = list(zip([0, *ends[:-1]], ends))
    row = real // seg.t
    cells = (seg.rows[row], seg.start[row] + real % seg.t)
    rows, starts, lens = seg.host()
    row_keys = []
    for r, s0, n in zip(rows, starts, lens):
        end, views = s0 + n, {}
        cuts = {w: w if w and end > w else 0 for w in windows}  # a window cutting none of the row: full
        for w in set(cuts.values()):
            first = max(0, s0 - w + 1) if w else 0
            mask = None
            if w or not seg.fresh or slopes is not None or softcap:
                cols, query = keys[None, first:end], s0 + keys[:n, None]
                mask = ((cols <= query) & (cols > query - w) if w else cols <= query)[None, None]
                if slopes is not None:  # ALiBi: (1, h, len, keys)
                    bias = slopes[None, :, None, None] * cols.to(torch.float32)[None, None]
                    mask = torch.where(mask, bias, torch.tensor(float("-inf"))).to(dtype)
            views[w] = (first, mask)
        row_keys.append((r, end, {w: views[c] for w, c in cuts.items()}))
    return spans, cells, row_keys


def attend_by_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: "StageContext", layer: int, window: int,
                  attend: Callable, scale: float) -> torch.Tensor:
    """q (n, h, d), k / v (n, kvh, d) of the real tokens -> (n, h * d): the keys and values written to
    the cache, then each row attending over its own keys (``attend(q, k, v, mask)``, (1, heads, len,
    d) views): its new tokens (fresh prompts; causal masking by the kernel unless the layer's
    ``window`` cuts the row), or the columns of its cache row its queries see, with its mask. With
    ``ctx.packed`` (fresh prompts on a GPU) all rows in one :func:`attend_packed` call instead."""
    cache = ctx.cache
    if cache is not None:
        rows, cols = ctx.real_cells
        cache.store(layer, rows, cols, k, v)
    if ctx.packed is not None:
        return attend_packed(q, k, v, ctx.packed, window, scale)
    outs = []
    for (a, e), (row, end, views) in zip(ctx.spans, ctx.row_keys):
        if a == e:  # nothing new in this row
            continue
        first, mask = views[window]
        if end == e - a:  # a fresh prompt: its keys are its new tokens
            kr, vr = k[a:e].transpose(0, 1)[None], v[a:e].transpose(0, 1)[None]
        else:
            kr, vr = cache.read(layer, slice(row, row + 1), slice(first, end), q.dtype)
        outs.append(attend(q[a:e].transpose(0, 1)[None], kr, vr, mask)[0].transpose(0, 1))  # (len, h, d)
    return torch.cat(outs).flatten(1)
