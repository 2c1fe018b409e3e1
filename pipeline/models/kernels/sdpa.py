"""Attention over a segment's queries and its keys, in the forms PyTorch's fast kernels accept.

:func:`attend` picks the SDPA call per layout (plain causal, one query per row with GQA, explicit
mask); :func:`softcapped_attention` is Gemma 2's tanh-capped scores, which SDPA cannot express;
:func:`kv_runs` splits a segment's rows so that attention over the cache reads few padded columns.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# What one more attention call costs, in bytes of keys and values it could have read instead: on CPU
# ~20 us per SDPA call against ~25 GB/s of memory bandwidth (2 cores, measured), on a GPU ~10 us of
# launch against ~1.5 TB/s.
CALL_BYTES = {"cpu": 512 << 10, "cuda": 16 << 20}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Scaled dot-product attention in the forms the fast kernels (FlashAttention, memory-efficient)
    accept. q (b, h, t, d); k/v (b, kvh, kv, d); mask bool (b, 1, t, kv), additive (b, h, t, kv), or
    None for a plain causal layout (query i sees keys 0..i: fresh prompts, each row from column 0).

    - causal: ``is_causal`` with no mask, GQA through ``enable_gqa`` (no K/V repeat);
    - one query per row (decode) with GQA: the g query heads that share a K/V head take the place of
      the query axis, (b, kvh, g, d), so the per-row mask applies without repeating K/V;
    - otherwise the explicit mask (SDPA then repeats K/V for GQA)."""
    b, h, t, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=g > 1)
    if t == 1 and g > 1:
        m = mask if mask.shape[1] == 1 else mask.reshape(mask.shape[0], kvh, g, mask.shape[-1])
        out = _decode_attention(q.reshape(b, kvh, g, d), k, v, m, scale)
        return out.reshape(b, h, 1, d)
    if t == 1:
        return _decode_attention(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=g > 1)


def _decode_attention(q, k, v, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row (or the g query heads of a K/V head in its place): q (b, kvh, g, d).

    On the CPU in float32 two batched matmuls and a softmax read the keys and values faster than the
    flash kernel, which walks them in blocks with per-block bookkeeping. In bfloat16 the flash kernel
    wins (oneDNN's bf16 batched matmul of one row is slow), on GPUs its fused kernels do."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or mask.dtype != torch.bool:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def softcapped_attention(q, k, v, mask: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    """Attention with Gemma 2's tanh soft-capping of the scores (SDPA has no such option).
    q (b, h, t, d); k/v (b, kvh, kv, d); mask bool (b, 1, t, kv) or additive."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v


def kv_runs(rows: list[int], ends: list[int], cols: int, cell_bytes: int, device: str) -> list[tuple[int, int, int]] | None:
    """Split a segment's rows into runs that each attend to the cache columns of their own longest row.

    ``rows``: each segment row's cache row; ``ends``: the cache columns it reads (its last position
    + 1); ``cols``: the columns one call over all rows reads (the longest row's). One call reads
    ``len(rows) x cols`` cells, most of them padding when lengths differ (a short row next to a long
    one); a run of consecutive cache rows is a view of the cache (no copy), so splitting costs only the
    extra calls (:data:`CALL_BYTES`). The split minimising cells read + calls is found by dynamic
    programming over run boundaries (O(rows^2), once per segment). Returns ``[(first, stop, cols)]``
    (segment rows ``first..stop-1`` are cache rows ``rows[first]..``, reading ``cols`` columns), or
    None when one call reads least (rows that are not consecutive then pay a gather: 3x the cells)."""
    n = len(rows)
    call = CALL_BYTES.get(device, CALL_BYTES["cuda"]) / cell_bytes  # in cells
    ends = [min(e, cols) for e in ends]
    consecutive = all(b == a + 1 for a, b in zip(rows, rows[1:]))
    if consecutive and n * cols - sum(ends) <= call:  # all the padding is worth less than one more call
        return None
    best, cut = [0.0] + [math.inf] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        longest = 0
        for i in range(j - 1, -1, -1):
            if i < j - 1 and rows[i + 1] != rows[i] + 1:
                break
            longest = max(longest, ends[i])
            cost = best[i] + call + (j - i) * longest
            if cost < best[j]:
                best[j], cut[j] = cost, i
    if best[n] >= call + n * cols * (1 if consecutive else 3):
        return None
    runs, j = [], n
    while j:
        i = cut[j]
        runs.append((i, j, max(ends[i:j])))
        j = i
    return runs[::-1]
