"""Attention over a segment's queries and its keys, in the forms PyTorch's fast kernels accept.

:func:`attend` picks the SDPA call per layout (plain causal, one query per row with GQA, explicit
mask); :func:`softcapped_attention` is Gemma 2's tanh-capped scores, which SDPA cannot express.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
        out = F.scaled_dot_product_attention(q.reshape(b, kvh, g, d), k, v, attn_mask=m, scale=scale)
        return out.reshape(b, h, 1, d)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=g > 1)


def softcapped_attention(q, k, v, mask: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    """Attention with Gemma 2's tanh soft-capping of the scores (SDPA has no such option).
    q (b, h, t, d); k/v (b, kvh, kv, d); mask bool (b, 1, t, kv) or additive."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v
