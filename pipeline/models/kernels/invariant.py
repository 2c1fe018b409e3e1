"""Batch-invariant kernels (``--batch-invariant``): a row's numbers never depend on what else shares its
micro-batch, the budget, the pipeline size or the thread count. Row-wise ops run on fixed tiles of
``ROW_TILE`` rows (:func:`map_rows`); matmuls sum over fixed ``K_PIECE``-wide pieces in order
(:func:`fixed_linear`: a BLAS may split a long reduction among threads); SiLU/GELU run in pieces one
thread computes (:func:`fixed_elementwise`); attention runs one row at a time (:func:`attend_rows`);
rotary tables are built in fixed blocks (:class:`RopeTable`). Why each, and what is measured:
docs/design/determinism.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ROW_TILE = 16  # rows per call in batch-invariant mode
K_PIECE = 256  # input features per matmul piece (512 measured invariant too, 1024 not: fixed_linear)
PIECE = 16384  # elements per element-wise call: below ATen's parallel grain (32768), so one thread
VEC_ALIGN = 64  # elements per step of ATen's widest vector loop (2 x 32 bf16 lanes on AVX-512)
ROPE_BLOCK = 64  # positions per rotary-table block


def map_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """``fn`` over the rows of ``x`` (..., w) in calls of exactly ``tile`` rows (zero-padded); ``tile`` 0:
    ``fn(x)`` (not batch-invariant)."""
    if not tile:
        return fn(x)
    lead, w = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, w)
    n = flat.shape[0]
    pad = (-n) % tile
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, w)])
    out = torch.cat([fn(part) for part in flat.split(tile)])
    return out[:n].reshape(*lead, out.shape[-1])


def fixed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for x (..., k), summed over ``K_PIECE`` input features at a time, in
    order: the same reduction whatever the thread count (MKL on an AVX-512 Xeon splits K >= 1024 among
    threads; pieces this short never are: measured bit-identical for 1-4 threads, test_invariant.py)."""
    k = x.shape[-1]
    y = F.linear(x[..., :K_PIECE], weight[:, :K_PIECE])
    for c in range(K_PIECE, k, K_PIECE):
        y.add_(F.linear(x[..., c : c + K_PIECE], weight[:, c : c + K_PIECE]))
    return y if bias is None else y + bias


class FixedLinear(torch.nn.Linear):
    """``nn.Linear`` computed by :func:`fixed_linear` (batch-invariant stages swap their layers' class:
    the parameters, and so the checkpoint names, are nn.Linear's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fixed_linear(x, self.weight, self.bias)


def fix_linears(model: torch.nn.Module) -> None:
    """Make every plain ``nn.Linear`` in ``model`` a :class:`FixedLinear` (same parameters)."""
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = FixedLinear


def fixed_elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """An element-wise ``fn`` over x (n, w) computed the same way for every row whatever n and the threads.

    ATen splits a large element-wise op among threads at arbitrary offsets and computes each piece's tail
    with scalar code, whose last bit can differ: rows whose width is a multiple of the vector step go in
    groups of at most ``PIECE`` elements (no scalar tail); other rows go one at a time (each has the same
    tail); rows wider than a piece are cut at the same columns.
    """
    n, w = x.shape
    if w % VEC_ALIGN == 0 and w <= PIECE:
        return torch.cat([fn(part) for part in x.split(PIECE // w)])
    if w <= PIECE:
        return torch.cat([fn(x[i : i + 1]) for i in range(n)])
    return torch.cat([torch.cat([fn(x[i : i + 1, c : c + PIECE]) for c in range(0, w, PIECE)], dim=1)
                      for i in range(n)])


def attend_rows(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], starts: list[int],
                lens: list[int], slopes: torch.Tensor | None, gqa: bool, scale: float | None = None,
                softcap: float = 0.0, window: int = 0, key_starts: list[int] | None = None) -> torch.Tensor:
    """Attention of each row alone: q (b, h, t, d); keys[i]/values[i] (1, kvh, L_i, d) hold row i's
    keys from position ``key_starts[i]`` (default 0) up to its last new token. Row i's first
    ``lens[i]`` queries sit at positions ``starts[i]..``; its padded queries get zeros. ``window``:
    a query sees only the last ``window`` positions (itself included). Returns (b, h, t, d).
    A fresh prompt (no ALiBi, soft-capping or shorter window) goes through SDPA's causal kernel, which
    splits work by query blocks whatever the threads; everything else through plain matmuls (SDPA's CPU
    kernel splits a single query's keys, and its masked path, by the thread count: test_invariant.py).
    A head that is not whole 64-byte lines (head_dim 10 in float32) takes plain matmuls on copies of the
    row's own: the BLAS's sums then follow where a view sits (so the micro-batch's shape), and SDPA's the
    thread count (measured for head_dim < 12).
    """
    b, h, t, d = q.shape
    scale = d**-0.5 if scale is None else scale
    out = q.new_zeros(b, h, t, d)
    lines = d * q.element_size() % 64 == 0
    for i in range(b):
        n, k, v = lens[i], keys[i], values[i]
        qi = q[i : i + 1, :, :n]
        if not lines:
            qi, k, v = (x.clone(memory_format=torch.contiguous_format) for x in (qi, k, v))
        first = key_starts[i] if key_starts else 0
        if lines and slopes is None and not softcap and starts[i] == 0 and n > 1 and (not window or n <= window):
            out[i : i + 1, :, :n] = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale,
                                                                    enable_gqa=gqa)
        else:
            out[i, :, :n] = _plain_attention(qi[0], k[0], v[0], starts[i], slopes, scale, softcap, window, first)
    return out


def _plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, slopes: torch.Tensor | None,
                     scale: float, softcap: float = 0.0, window: int = 0, first: int = 0) -> torch.Tensor:
    """q (h, n, d) at positions start..start+n-1; k/v (kvh, L, d) at positions first..first+L-1
    -> (h, n, d), causal (+ sliding window, ALiBi, soft-capping)."""
    h, n, d = q.shape
    kvh, big_l, _ = k.shape
    g = h // kvh
    qg = q.reshape(kvh, g * n, d)  # query heads grouped by their KV head (GQA without copies)
    scores = ((qg @ k.transpose(1, 2)) * scale).float().reshape(kvh, g, n, big_l)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    keys = torch.arange(first, first + big_l, device=q.device)
    if slopes is not None:
        scores = scores + (slopes[:, None] * keys.float()).reshape(kvh, g, 1, big_l)
    queries = torch.arange(start, start + n, device=q.device)[:, None]
    if n > 1 or start + n < first + big_l or window:
        allowed = keys[None, :] <= queries  # (n, L)
        if window:
            allowed = allowed & (keys[None, :] > queries - window)
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).reshape(kvh, g * n, big_l)
    return (probs @ v).reshape(h, n, d)


class RopeTable:
    """cos/sin of ``position x inv_freq``, built in fixed blocks of positions as they are needed.

    Each block is one (ROPE_BLOCK, rotary_dim/2) element-wise call, so a position's entry is the
    same whichever block size the run needed first and however many threads computed it.
    """

    def __init__(self, inv_freq: torch.Tensor, scale: float = 1.0):
        self.inv_freq, self.scale = inv_freq, scale  # (rd/2,) float32; cos/sin multiplier (longrope)
        self.cos = torch.empty(0, inv_freq.numel(), device=inv_freq.device)
        self.sin = torch.empty_like(self.cos)

    def ensure(self, positions: int) -> None:
        """Make rows 0..positions-1 available (host-side length: no device sync)."""
        have = self.cos.shape[0]
        if positions <= have:
            return
        blocks_c, blocks_s = [self.cos], [self.sin]
        for base in range(have, positions, ROPE_BLOCK):
            pos = torch.arange(base, base + ROPE_BLOCK, device=self.inv_freq.device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq[None, :]
            cos, sin = freqs.cos(), freqs.sin()
            if self.scale != 1.0:
                cos, sin = cos * self.scale, sin * self.scale
            blocks_c.append(cos)
            blocks_s.append(sin)
        self.cos, self.sin = torch.cat(blocks_c), torch.cat(blocks_s)

    def lookup(self, pos: torch.Tensor, limit: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """pos (b, t) with every entry < ``limit`` -> cos, sin (b, 1, t, rd/2) in ``dtype``."""
        self.ensure(limit)
        return self.cos[pos][:, None].to(dtype), self.sin[pos][:, None].to(dtype)
