"""Prefill without padding: the new prompts of a pass are right-padded to the longest for
attention's (b, t) layout, but a layer's projections and MLP run on the real tokens only.

Prompts of different lengths share a prefill: a pass of prompts of 9..241 tokens is about half
padding, which every projection and MLP would otherwise compute. Attention goes row by row over each
prompt's own keys (:func:`attend_by_row`, views: its new tokens, or its cache row when it resumes
after cached tokens; a sliding layer's row with its window's mask, an ALiBi model's with its biases;
causal attention costs a row its length squared, so the padded batch paid ~2.5x).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Callable

import torch

from ..upload import to_device

if TYPE_CHECKING:
    from .context import Segment, StageContext

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
                  attend: Callable) -> torch.Tensor:
    """q (n, h, d), k / v (n, kvh, d) of the real tokens -> (n, h * d): the keys and values written to
    the cache, then each row attending over its own keys (``attend(q, k, v, mask)``, (1, heads, len,
    d) views): its new tokens (fresh prompts; causal masking by the kernel unless the layer's
    ``window`` cuts the row), or the columns of its cache row its queries see, with its mask."""
    cache = ctx.cache
    if cache is not None:
        rows, cols = ctx.real_cells
        cache.k[layer][rows, :, cols] = k
        cache.v[layer][rows, :, cols] = v
    outs = []
    for (a, e), (row, end, views) in zip(ctx.spans, ctx.row_keys):
        if a == e:  # nothing new in this row
            continue
        first, mask = views[window]
        if end == e - a:  # a fresh prompt: its keys are its new tokens
            kr, vr = k[a:e].transpose(0, 1)[None], v[a:e].transpose(0, 1)[None]
        else:
            kr, vr = cache.k[layer][row : row + 1, :, first:end], cache.v[layer][row : row + 1, :, first:end]
        outs.append(attend(q[a:e].transpose(0, 1)[None], kr, vr, mask)[0].transpose(0, 1))  # (len, h, d)
    return torch.cat(outs).flatten(1)
