"""One compact decoder for every family, sliced into pipeline stages.

A :class:`StageModel` holds ``embed?`` + ``layers[first:last]`` + ``head?`` of a model described by
a :class:`~pipeline.models.spec.DecoderSpec`; modules a stage does not own are ``None``.
Nothing here knows about ranks or processes: the engine hands it one *segment* at a time (a few
rows of one micro-batch with their positions and cache columns, see :class:`Segment`).

Cache layout: each row of a micro-batch keeps its own tokens at cache columns ``0..len-1``
(right-ragged, no left padding), so a row's positions are simply its column indices, whatever the
other rows hold. That makes rotary, learned and ALiBi positions per-row by construction and lets a
finished row take a new request (continuous refill) without moving anybody else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .invariant import RopeTable, attend_rows, fixed_elementwise, map_rows
from .moe import SparseMoE
from .spec import DecoderSpec, RopeSpec

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def rope_inv_freq(rope: RopeSpec) -> torch.Tensor:
    """inv_freq for the rotary dims, with linear or llama3 scaling as HF computes it (float32)."""
    rd = rope.rotary_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    if rope.scaling_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.scaling_type == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope.scaling_type != "default":
        raise ValueError(f"unsupported rope scaling {rope.scaling_type!r}")
    return inv_freq.float()


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes (BLOOM's construction, including non-power-of-two head counts)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


@dataclass
class Segment:
    """Rows of one micro-batch that run together through a stage.

    ``rows`` (b,) index the micro-batch's cache; row r's ``t`` new tokens go to cache columns
    ``start[r] .. start[r] + t - 1`` (right padding past ``lens[r]`` is computed but never
    attended). ``kv_len`` is how many cache columns attention reads.
    """

    rows: torch.Tensor  # (b,) long
    start: torch.Tensor  # (b,) long
    t: int
    kv_len: int
    all_rows: bool = False  # rows == arange(R): read the cache without a gather
    fresh: bool = False  # every start is 0: attend to the new keys only
    # Host copies, needed only by batch-invariant attention (one row at a time); read from the
    # device tensors when absent. ``lens``: real new tokens per row (the rest is right padding).
    host_rows: list[int] | None = None
    host_start: list[int] | None = None
    lens: list[int] | None = None

    def host(self) -> tuple[list[int], list[int], list[int]]:
        """(rows, starts, real new tokens) per row as Python lists."""
        rows = self.host_rows if self.host_rows is not None else self.rows.tolist()
        start = self.host_start if self.host_start is not None else self.start.tolist()
        return rows, start, self.lens if self.lens is not None else [self.t] * len(rows)

    @property
    def positions(self) -> torch.Tensor:  # (b, t)
        return self.start[:, None] + torch.arange(self.t, device=self.start.device)[None, :]


class Norm(nn.Module):
    def __init__(self, dim: int, kind: str, eps: float, bias: bool, tile: int = 0):
        super().__init__()
        self.kind, self.eps, self.tile = kind, eps, tile
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return map_rows(self._norm, x, self.tile) if self.tile else self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layer":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


class KVCache:
    """Preallocated keys/values of one micro-batch on one stage: (layers, rows, kv_heads, cols, head_dim)."""

    def __init__(self, layers: int, rows: int, cols: int, spec: DecoderSpec, dtype, device):
        shape = (layers, rows, spec.num_kv_heads, cols, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def cols(self) -> int:
        return self.k.shape[3]

    def fork(self, src: int, dsts: list[int], ncols: int) -> None:
        """Copy row ``src``'s first ``ncols`` columns to ``dsts`` (best_of shares one prefill)."""
        idx = torch.tensor(dsts, device=self.k.device)
        self.k[:, idx, :, :ncols] = self.k[:, src : src + 1, :, :ncols]
        self.v[:, idx, :, :ncols] = self.v[:, src : src + 1, :, :ncols]


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, tile: int = 0):
        super().__init__()
        self.spec, self.tile = spec, tile
        self.qkv = nn.Linear(spec.hidden_size, spec.q_dim + 2 * spec.kv_dim, bias=spec.qkv_bias)
        self.o = nn.Linear(spec.q_dim, spec.hidden_size, bias=spec.o_bias)
        qk = spec.qk_norm
        self.q_norm = Norm(spec.head_dim, "rms", spec.norm_eps, False, tile) if qk else None
        self.k_norm = Norm(spec.head_dim, "rms", spec.norm_eps, False, tile) if qk else None

    def _rows(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return map_rows(layer, x, self.tile) if self.tile else layer(x)

    def forward(self, x, seg: Segment, ctx: "StageContext", layer: int) -> torch.Tensor:
        s = self.spec
        b, t, _ = x.shape
        q, k, v = self._rows(self.qkv, x).split([s.q_dim, s.kv_dim, s.kv_dim], dim=-1)
        q = q.view(b, t, s.num_heads, s.head_dim)
        k = k.view(b, t, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (b, h, t, d), (b, kvh, t, d)
        v = v.view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        if ctx.cos is not None:
            q, k = apply_rope(q, ctx.cos, ctx.sin, s.rope), apply_rope(k, ctx.cos, ctx.sin, s.rope)
        cache = ctx.cache
        if cache is not None:
            cols = seg.positions.clamp(max=cache.cols - 1)  # (b, t)
            cache.k[layer][seg.rows[:, None], :, cols] = k.transpose(1, 2)
            cache.v[layer][seg.rows[:, None], :, cols] = v.transpose(1, 2)
        if self.tile:
            out = self._attend_rows(q, k, v, seg, ctx, layer)
        else:
            if cache is not None and not seg.fresh:
                sel = slice(None) if seg.all_rows else seg.rows
                k = cache.k[layer][sel, :, : seg.kv_len]
                v = cache.v[layer][sel, :, : seg.kv_len]
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=ctx.mask, enable_gqa=s.num_heads != s.num_kv_heads
            )
        return self._rows(self.o, out.transpose(1, 2).reshape(b, t, s.q_dim))

    def _attend_rows(self, q, k, v, seg: Segment, ctx: "StageContext", layer: int) -> torch.Tensor:
        """Batch-invariant attention: each row with exactly its own key length."""
        rows, starts, lens = seg.host()
        if seg.fresh or ctx.cache is None:  # keys are this segment's own: row i's first lens[i]
            keys = [k[i : i + 1, :, : lens[i]] for i in range(len(rows))]
            values = [v[i : i + 1, :, : lens[i]] for i in range(len(rows))]
        else:
            ck, cv = ctx.cache.k[layer], ctx.cache.v[layer]
            keys = [ck[r : r + 1, :, : s0 + n] for r, s0, n in zip(rows, starts, lens)]
            values = [cv[r : r + 1, :, : s0 + n] for r, s0, n in zip(rows, starts, lens)]
        return attend_rows(q, keys, values, starts, lens, ctx.slopes, self.spec.num_heads != self.spec.num_kv_heads)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Rotate the first rotary_dim dims of x (b, h, t, d); cos/sin are (b, 1, t, rotary_dim/2)."""
    rd = rope.rotary_dim
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    if rope.interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2 :]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec, tile: int = 0):
        super().__init__()
        self.gated, self.tile = spec.mlp == "gated", tile
        width = 2 * spec.intermediate_size if self.gated else spec.intermediate_size
        self.up = nn.Linear(spec.hidden_size, width, bias=spec.mlp_bias)  # gated: [gate; up]
        self.down = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.act = _ACTIVATIONS[spec.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return map_rows(self._mlp, x, self.tile) if self.tile else self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        act = (lambda a: fixed_elementwise(self.act, a)) if self.tile else self.act  # tile: x is (rows, w)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return self.down(act(gate.contiguous() if self.tile else gate) * up)
        return self.down(act(h))


class Block(nn.Module):
    """Decoder layer ``index`` (global, counted over the whole model)."""

    def __init__(self, spec: DecoderSpec, index: int, tile: int = 0):
        super().__init__()
        self.spec, self.index = spec, index
        self.n1 = Norm(spec.hidden_size, spec.norm, spec.norm_eps, spec.norm_bias, tile)
        self.n2 = None if spec.shared_norm else Norm(spec.hidden_size, spec.norm, spec.norm_eps, spec.norm_bias, tile)
        self.attn = Attention(spec, tile)
        self.mlp = SparseMoE(spec, tile) if spec.moe and spec.moe.sparse(index) else MLP(spec, tile)

    def forward(self, x, seg: Segment, ctx: "StageContext", layer: int) -> torch.Tensor:
        s = self.spec
        if s.parallel_residual:
            h = self.n1(x)
            return x + self.attn(h, seg, ctx, layer) + self.mlp(h if s.shared_norm else self.n2(x))
        if s.pre_norm:
            x = x + self.attn(self.n1(x), seg, ctx, layer)
            return x + self.mlp(self.n2(x))
        x = self.n1(x + self.attn(x, seg, ctx, layer))  # post-norm (OPT-350m)
        return self.n2(x + self.mlp(x))


@dataclass
class StageContext:
    """What every layer of a stage shares for one segment: cache, mask, rotary tables."""

    cache: KVCache | None
    mask: torch.Tensor | None  # bool (b, 1, t, kv) or additive float (b, h, t, kv) with ALiBi; None: per-row
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    slopes: torch.Tensor | None = None  # ALiBi head slopes (per-row attention builds its own bias)


class StageModel(nn.Module):
    """embed? + layers[first:last] + head? of one model. Layer ``i`` here is global ``first + i``.

    ``row_tile`` > 0 selects batch-invariant kernels (:mod:`.invariant`): every row-wise op runs
    on calls of exactly that many rows and attention runs one row at a time.
    """

    def __init__(self, spec: DecoderSpec, first: int, last: int, has_embed: bool, has_head: bool,
                 row_tile: int = 0):
        super().__init__()
        self.spec, self.first, self.last = spec, first, last
        self.has_embed, self.has_head, self.row_tile = has_embed, has_head, row_tile
        s, tile = spec, row_tile
        self.embed = nn.Embedding(s.vocab_size, s.word_dim) if has_embed else None
        self.proj_in = nn.Linear(s.word_dim, s.hidden_size, bias=False) if has_embed and s.embed_dim else None
        learned = has_embed and s.position == "learned"
        self.pos_embed = nn.Embedding(s.max_positions + s.learned_pos_offset, s.hidden_size) if learned else None
        self.embed_norm = Norm(s.hidden_size, s.norm, s.norm_eps, s.norm_bias, tile) if has_embed and s.embed_norm else None
        self.layers = nn.ModuleList(Block(s, i, tile) for i in range(first, last))
        self.final_norm = Norm(s.hidden_size, s.norm, s.norm_eps, s.norm_bias, tile) if has_head and s.final_norm else None
        self.proj_out = nn.Linear(s.hidden_size, s.word_dim, bias=False) if has_head and s.embed_dim else None
        self.lm_head = nn.Linear(s.word_dim, s.vocab_size, bias=s.lm_head_bias) if has_head else None
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the non-persistent tables; called again after building on the meta device."""
        device = self.layers[0].n1.weight.device if len(self.layers) else next(self.parameters()).device
        self.rope_table = None
        if self.spec.position == "rope":
            self.register_buffer("inv_freq", rope_inv_freq(self.spec.rope).to(device), persistent=False)
            if device.type != "meta":
                self.rope_table = RopeTable(self.inv_freq)
        if self.spec.position == "alibi":
            self.register_buffer("slopes", alibi_slopes(self.spec.num_heads).to(device), persistent=False)

    def new_cache(self, rows: int, cols: int) -> KVCache:
        p = next(self.parameters())
        return KVCache(len(self.layers), rows, cols, self.spec, p.dtype, p.device)

    def _rows(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return map_rows(layer, x, self.row_tile) if self.row_tile else layer(x)

    def embed_tokens(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(b, t) token ids -> (b, t, hidden)."""
        x = self.embed(ids)
        if self.proj_in is not None:
            x = self._rows(self.proj_in, x)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions + self.spec.learned_pos_offset)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return x

    def context(self, seg: Segment, cache: KVCache | None, dtype: torch.dtype) -> StageContext:
        """Mask and rotary tables for one segment, built once and shared by all layers."""
        pos = seg.positions  # (b, t)
        kv = seg.t if seg.fresh else seg.kv_len
        cos = sin = mask = None
        if self.spec.position == "rope":
            cos, sin = self.rope_table.lookup(pos, kv, dtype)  # positions < kv_len (decode), < t (fresh)
        slopes = self.slopes if self.spec.position == "alibi" else None
        if self.row_tile:
            return StageContext(cache, None, cos, sin, slopes)
        keys = torch.arange(kv, device=pos.device)
        if seg.fresh:
            mask = keys[None, None, :] <= torch.arange(seg.t, device=pos.device)[None, :, None]
            mask = mask.expand(pos.shape[0], -1, -1)  # (b, t, kv)
        else:
            mask = keys[None, None, :] <= pos[:, :, None]
        mask = mask[:, None]  # (b, 1, t, kv)
        if slopes is not None:
            bias = slopes[None, :, None, None] * keys.float()[None, None, None, :]  # (1, h, 1, kv)
            mask = torch.where(mask, bias, torch.tensor(float("-inf"))).to(dtype)
        return StageContext(cache, mask, cos, sin, slopes)

    def forward(self, x: torch.Tensor, seg: Segment, cache: KVCache | None) -> torch.Tensor:
        """ids (b, t) on the first stage, hidden (b, t, hidden) elsewhere -> hidden (b, t, hidden)."""
        if self.embed is not None:
            x = self.embed_tokens(x, seg.positions)
        ctx = self.context(seg, cache, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, seg, ctx, i)
        return x

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """hidden (..., hidden) -> float32 logits (..., vocab)."""
        return map_rows(self._head, h, self.row_tile) if self.row_tile else self._head(h)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        if self.final_norm is not None:
            h = self.final_norm._norm(h)  # already inside a tile when tiling
        if self.proj_out is not None:
            h = self.proj_out(h)
        return self.lm_head(h).float()
