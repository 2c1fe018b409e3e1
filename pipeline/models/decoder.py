"""One compact decoder for every family, sliced into pipeline stages.

A :class:`StageModel` holds ``embed?`` + ``layers[first:last]`` + ``head?`` of a model described by a
:class:`~pipeline.models.spec.DecoderSpec` (modules a stage does not own are ``None``) and runs one
*segment* at a time (:class:`Segment`). Each cache row keeps its own tokens at columns ``0..len-1``
(right-ragged, no left padding), so a row's positions are its column indices whatever the other rows
hold: positions are per-row by construction and a finished row can take a new request alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.kernels.invariant import attend_rows, fix_linears, fixed_linear, map_rows
from pipeline.models.kernels import native
from pipeline.models.context import Segment, StageContext  # noqa: F401 (Segment re-exported)
from pipeline.cache.kv_cache import KVCache
from pipeline.models.kernels.logits import float32_linear
from pipeline.models.lora import StageAdapters
from pipeline.models.moe import SparseMoE
from pipeline.models.positions import Rotary, alibi_slopes, apply_rope
from pipeline.models.kernels.sdpa import attend, kv_runs, softcapped_attention
from pipeline.models.spec import DecoderSpec
from pipeline.models.mlp import MLP  # noqa: F401 (re-exported)
from pipeline.models.kernels.unpad import attend_by_row, packed_layout, real_tokens, row_layout


class Norm(nn.Module):
    """LayerNorm, or RMSNorm scaled by ``offset + weight`` (Gemma: 1 + weight); ``scale_fp32``
    multiplies by the weight before casting back (Gemma, OLMo 2) rather than after (Llama)."""

    def __init__(self, dim: int, kind: str, eps: float, bias: bool, tile: int = 0, offset: float = 0.0,
                 scale_fp32: bool = False):
        super().__init__()
        self.kind, self.eps, self.tile = kind, eps, tile
        self.offset, self.scale_fp32 = offset, scale_fp32 or bool(offset)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return map_rows(self._norm, x, self.tile)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layer":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        xf = x.float()  # one upcast for both uses (bf16 / fp16; float32: x itself)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_fp32:
            return (normed * (self.weight.float() + self.offset)).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def make_norm(spec: DecoderSpec, dim: int, tile: int = 0) -> Norm:
    """A norm of the spec's kind over ``dim`` features."""
    return Norm(dim, spec.norm, spec.norm_eps, spec.norm_bias, tile, spec.norm_offset, spec.norm_scale_fp32)


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, index: int, tile: int = 0):
        super().__init__()
        self.spec, self.tile = spec, tile
        self.window = spec.sliding_window if spec.is_sliding(index) else 0
        local = spec.layer_kinds and spec.layer_kinds[index] == "sliding" and spec.local_rope is not None
        self.rope_key = "local" if local else "global"
        self.scale = spec.attn_scale or spec.head_dim**-0.5
        self.qkv = nn.Linear(spec.hidden_size, spec.q_dim + 2 * spec.kv_dim, bias=spec.qkv_bias)
        self.o = nn.Linear(spec.q_dim, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            head = spec.qk_norm == "head"
            self.q_norm = make_norm(spec, spec.head_dim if head else spec.q_dim, tile)
            self.k_norm = make_norm(spec, spec.head_dim if head else spec.kv_dim, tile)

    def forward(self, x, seg: Segment, ctx: "StageContext", layer: int) -> torch.Tensor:
        """x (b, t, hidden), or (real tokens, hidden) when ``ctx.real`` is set (unpadded prefill)."""
        s = self.spec
        qkv = map_rows(self.qkv, x, self.tile)
        if ctx.lora is not None:
            qkv = ctx.lora.add(layer, "attn.qkv", x, qkv)
        if ctx.real is not None:  # unpadded prompts, row by row (see context)
            out = self._prompt_rows(qkv, ctx, layer)
            y = self.o(out)
            return y if ctx.lora is None else ctx.lora.add(layer, "attn.o", out, y)
        q, k, v = self._heads(qkv, ctx)  # (b, t, h, d), (b, t, kvh, d), (b, t, kvh * d)
        b, t = q.shape[:2]
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (b, h, t, d), (b, kvh, t, d)
        v = v.reshape(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        cache = ctx.cache
        if cache is not None:
            cache.store(layer, seg.rows[:, None], seg.positions.clamp(max=cache.cols - 1), k.transpose(1, 2),
                        v.transpose(1, 2))
        if self.tile:
            out = self._attend_rows(q, k, v, seg, ctx, layer)
        elif ctx.decode is not None:
            out = native.decode_attention(q, cache.k[layer], cache.v[layer], *ctx.decode, self.window, self.scale)
        else:
            mask = ctx.masks.get(self.window)  # None: a plain causal layout
            if ctx.runs is not None:  # consecutive cache rows: views, each run its own columns
                out = torch.cat([self._attend(q[i:j], *cache.read(layer, slice(r, r + j - i), slice(n), q.dtype),
                                              mask[i:j, ..., :n]) for i, j, r, n in ctx.runs])
            else:
                if cache is not None and not seg.fresh:
                    sel = slice(None) if seg.all_rows else seg.rows
                    k, v = cache.read(layer, sel, slice(seg.kv_len), q.dtype)
                out = self._attend(q, k, v, mask)
        out = out.transpose(1, 2).reshape(b, t, s.q_dim)
        y = map_rows(self.o, out, self.tile)
        return y if ctx.lora is None else ctx.lora.add(layer, "attn.o", out, y)

    def _prompt_rows(self, qkv: torch.Tensor, ctx: "StageContext", layer: int) -> torch.Tensor:
        """New prompt tokens, unpadded (n real tokens, row after row): each row attends over its own
        keys only (its new tokens, or its cache row when it resumes after cached tokens), causally
        (within its window; ALiBi, soft-capping), never a padded (b, t) batch, which did ~2.5x the work."""
        s = self.spec
        q, k, v = self._heads(qkv, ctx)  # (n, h, d), (n, kvh, d), (n, kvh * d)
        v = v.unflatten(-1, (s.num_kv_heads, s.head_dim))
        return attend_by_row(q, k, v, ctx, layer, self.window, self._attend, self.scale)

    def _attend(self, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        if self.spec.attn_softcap:
            return softcapped_attention(q, k, v, mask, self.scale, self.spec.attn_softcap)
        return attend(q, k, v, mask, self.scale)

    def _heads(self, qkv: torch.Tensor, ctx: "StageContext"):
        """(..., q_dim + 2 kv_dim) -> q (..., h, d), k (..., kvh, d) normed and rotated; v as is.
        Rotary tables are (b, 1, t, rd/2) for (b, t, ...) or (n, 1, rd/2) for the real tokens (n, ...)."""
        s = self.spec
        q, k, v = qkv.split([s.q_dim, s.kv_dim, s.kv_dim], dim=-1)
        if not s.qk_norm and self.rope_key in ctx.rope:  # q and k side by side: one rotation for both
            heads = (s.num_heads, s.num_kv_heads)
            qk = self._rotate(qkv[..., : s.q_dim + s.kv_dim].unflatten(-1, (sum(heads), s.head_dim)), ctx)
            return *qk.split(heads, dim=-2), v
        if s.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.unflatten(-1, (s.num_heads, s.head_dim)), k.unflatten(-1, (s.num_kv_heads, s.head_dim))
        if s.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_key in ctx.rope:
            q, k = self._rotate(q, ctx), self._rotate(k, ctx)
        return q, k, v

    def _rotate(self, x: torch.Tensor, ctx: "StageContext") -> torch.Tensor:
        cos, sin = ctx.rope[self.rope_key]
        if cos.dim() == 4:  # (b, 1, t, rd/2) against (b, t, h, d)
            cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
        return apply_rope(x, cos, sin, self.spec.local_rope if self.rope_key == "local" else self.spec.rope)

    def _attend_rows(self, q, k, v, seg: Segment, ctx: "StageContext", layer: int) -> torch.Tensor:
        """Batch-invariant attention: each row with exactly its own keys (a sliding layer: its window)."""
        rows, starts, lens = seg.host()
        w = self.window
        replay = seg.replay if seg.replay and seg.fresh and ctx.cache is not None else [0] * len(rows)
        if seg.fresh or ctx.cache is None:  # keys are this segment's own: row i's first lens[i]
            lens = [n - r for n, r in zip(lens, replay)]  # (a resumed row's generated tokens: below)
            firsts = [0] * len(rows)
            keys = [k[i : i + 1, :, : lens[i]] for i in range(len(rows))]
            values = [v[i : i + 1, :, : lens[i]] for i in range(len(rows))]
        else:  # a sliding row reads only the columns its first query can see
            firsts = [max(0, s0 - w + 1) if w else 0 for s0 in starts]
            kvs = [ctx.cache.read(layer, slice(r, r + 1), slice(f, s0 + n), q.dtype)
                   for r, f, s0, n in zip(rows, firsts, starts, lens)]
            keys, values = [k for k, _ in kvs], [v for _, v in kvs]
        shared = dict(slopes=ctx.slopes, gqa=self.spec.num_heads != self.spec.num_kv_heads, scale=self.scale,
                      softcap=self.spec.attn_softcap, window=w)
        out = attend_rows(q, keys, values, starts, lens, key_starts=firsts, **shared)
        for i in (i for i, r in enumerate(replay) if r):  # a row resumed mid-generation: its generated tokens
            for pos in range(lens[i], lens[i] + replay[i]):  # each as the decode step that computed it
                f = max(0, pos - w + 1) if w else 0
                kk, vv = ctx.cache.read(layer, slice(rows[i], rows[i] + 1), slice(f, pos + 1), q.dtype)
                out[i : i + 1, :, pos : pos + 1] = attend_rows(q[i : i + 1, :, pos : pos + 1], [kk], [vv], [pos], [1],
                                                               key_starts=[f], **shared)
        return out


def projections(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of every linear projection of the decoder layers in ``model``: ``qkv`` and
    ``o`` of each Attention, ``up`` and ``down`` of each MLP (shared experts' too); what int8 weights
    and prepacked CPU weights replace."""
    return [(m, name) for m in model.modules()
            for name in (("qkv", "o") if isinstance(m, Attention) else ("up", "down") if isinstance(m, MLP) else ())]


class Block(nn.Module):
    """Decoder layer ``index`` (global, counted over the whole model)."""

    def __init__(self, spec: DecoderSpec, index: int, tile: int = 0):
        super().__init__()
        self.spec, self.index = spec, index
        input_norms = spec.pre_norm or not spec.post_branch_norm  # OLMo 2 has only output norms
        self.n1 = make_norm(spec, spec.hidden_size, tile) if input_norms else None
        self.n2 = make_norm(spec, spec.hidden_size, tile) if input_norms and not spec.shared_norm else None
        self.post_attn_norm = make_norm(spec, spec.hidden_size, tile) if spec.post_branch_norm else None
        self.post_mlp_norm = make_norm(spec, spec.hidden_size, tile) if spec.post_branch_norm else None
        self.attn = Attention(spec, index, tile)
        self.mlp = SparseMoE(spec, tile) if spec.moe and spec.moe.sparse(index) else MLP(spec, tile)

    def forward(self, x, seg: Segment, ctx: "StageContext", layer: int) -> torch.Tensor:
        s = self.spec
        if s.parallel_residual:
            h = self.n1(x)
            return x + self.attn(h, seg, ctx, layer) + self._ffn(h if s.shared_norm else self.n2(x), ctx, layer)
        if not s.pre_norm and not s.post_branch_norm:  # post-norm (OPT-350m)
            x = self.n1(x + self.attn(x, seg, ctx, layer))
            return self.n2(x + self._ffn(x, ctx, layer))
        h = self.attn(self.n1(x) if self.n1 is not None else x, seg, ctx, layer)
        x = x + (self.post_attn_norm(h) if self.post_attn_norm is not None else h)
        h = self._ffn(self.n2(x) if self.n2 is not None else x, ctx, layer)
        return x + (self.post_mlp_norm(h) if self.post_mlp_norm is not None else h)

    def _ffn(self, x: torch.Tensor, ctx: "StageContext", layer: int) -> torch.Tensor:
        return self.mlp(x, ctx.lora, layer) if isinstance(self.mlp, MLP) else self.mlp(x)


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """``nn.Embedding`` without its random initialisation (the loader fills the table): its ``normal_``
    on the meta device imports ``torch._dynamo`` via ``torch._refs``, ~0.7 s of a stage's start."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


class StageModel(nn.Module):
    """embed? + layers[first:last] + head? of one model. Layer ``i`` here is global ``first + i``.
    ``row_tile`` > 0 selects batch-invariant kernels (:mod:`.invariant`): every row-wise op runs
    on calls of exactly that many rows and attention runs one row at a time."""

    def __init__(self, spec: DecoderSpec, first: int, last: int, has_embed: bool, has_head: bool,
                 row_tile: int = 0):
        super().__init__()
        self.spec, self.first, self.last = spec, first, last
        self.has_embed, self.has_head, self.row_tile = has_embed, has_head, row_tile
        self.kv_int8 = False  # --kv-cache-dtype int8: caches of int8 records (.kv_cache)
        s, tile = spec, row_tile
        self.embed = _embedding(s.vocab_size, s.word_dim) if has_embed else None
        self.proj_in = nn.Linear(s.word_dim, s.hidden_size, bias=False) if has_embed and s.embed_dim else None
        learned = has_embed and s.position == "learned"
        self.pos_embed = _embedding(s.max_positions + s.learned_pos_offset, s.hidden_size) if learned else None
        self.embed_norm = make_norm(s, s.hidden_size, tile) if has_embed and s.embed_norm else None
        self.layers = nn.ModuleList(Block(s, i, tile) for i in range(first, last))
        self.final_norm = make_norm(s, s.hidden_size, tile) if has_head and s.final_norm else None
        self.proj_out = nn.Linear(s.hidden_size, s.word_dim, bias=False) if has_head and s.embed_dim else None
        self.lm_head = nn.Linear(s.word_dim, s.vocab_size, bias=s.lm_head_bias) if has_head else None
        self.windows = sorted({layer.attn.window for layer in self.layers} | {0})
        if row_tile:  # batch-invariant: every linear layer reduces over fixed pieces
            fix_linears(self)
        self.adapters: StageAdapters | None = None  # LoRA factors of this stage's layers (pipeline.loading.adapters)
        self.init_buffers()

    def tie(self) -> None:
        """A stage holding both the embedding and the head of a model with tied embeddings: the head
        multiplies by the embedding table itself, as the checkpoint stores it once (a second copy would
        cost vocab x hidden, 0.8 GB for Llama-3.2-3B in bf16). Called once the stage has its storage
        (``to_empty`` would give each use of a shared parameter its own), before loading fills it once."""
        if self.spec.tie_embeddings and self.embed is not None and self.lm_head is not None \
                and self.lm_head.weight.shape == self.embed.weight.shape \
                and self.lm_head.weight.dtype == self.embed.weight.dtype:
            self.lm_head.weight = self.embed.weight

    def init_buffers(self) -> None:
        """(Re)compute the non-persistent tables; called again after building on the meta device."""
        # a buffer or parameter of the first layer (packed projections of quantized checkpoints have no weight)
        o = self.layers[0].attn.o if len(self.layers) else None
        device = next(iter(o.state_dict().values())).device if o is not None else next(self.parameters()).device
        self.rotary: dict[str, Rotary] = {}
        if self.spec.position == "rope" and device.type != "meta":
            for key in sorted({layer.attn.rope_key for layer in self.layers}):
                self.rotary[key] = Rotary(self.spec.local_rope if key == "local" else self.spec.rope, device)
        if self.spec.position == "alibi":
            self.register_buffer("slopes", alibi_slopes(self.spec.num_heads).to(device), persistent=False)

    def new_cache(self, rows: int, cols: int) -> KVCache:
        p = next(self.parameters())
        return KVCache(len(self.layers), rows, cols, self.spec, p.dtype, p.device, self.kv_int8)

    def embed_tokens(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(b, t) token ids -> (b, t, hidden)."""
        x = self.embed(ids)
        if self.spec.embed_scale:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        if self.proj_in is not None:
            x = map_rows(self.proj_in, x, self.row_tile)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions + self.spec.learned_pos_offset)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return x

    def _long_rows(self, seg: Segment, cache: KVCache | None) -> torch.Tensor | None:
        """longrope: per row, whether it uses the long factors. A row's prompt decides when it is
        prefilled (longer than the original context: long) and the cache keeps it for decoding."""
        rope = self.spec.rope
        if rope is None or rope.scaling_type != "longrope":
            return None
        if seg.fresh or seg.prefill or cache is None:
            lens = torch.tensor(seg.host()[2], device=seg.start.device) + seg.start
            flags = lens > rope.original_max_position
            if cache is not None:
                cache.long_rope[seg.rows] = flags
            return flags
        return cache.long_rope[seg.rows]

    def context(self, seg: Segment, cache: KVCache | None, dtype: torch.dtype) -> StageContext:
        """Masks and rotary tables for one segment, built once and shared by all layers."""
        pos = seg.positions  # (b, t)
        limit = seg.t if seg.fresh else seg.kv_len  # above every position (padding included)
        # keys read: a prefill resuming after cached tokens pads short rows past the cache's end
        kv = limit if cache is None or seg.fresh else min(limit, cache.cols)
        long_rows = self._long_rows(seg, cache) if self.rotary else None
        rope = {key: r.lookup(pos, limit, dtype, long_rows) for key, r in self.rotary.items()}
        real = None if self.row_tile else real_tokens(seg)
        if real is not None:  # the real tokens' rows of the tables: (n, 1, rd/2)
            rope = {key: tuple(c.squeeze(1).flatten(0, 1).index_select(0, real)[:, None] for c in cs)
                    for key, cs in rope.items()}
        slopes = self.slopes if self.spec.position == "alibi" else None
        lora = None
        if self.adapters is not None:  # unpadded: each adapter's tokens, else its rows
            lora = self.adapters.rows(seg.adapters, pos.device, seg.lens if real is not None else None)
        if self.row_tile:
            return StageContext(cache, {}, rope, slopes, lora)
        plain = slopes is None and not self.spec.attn_softcap  # the kernel's causal flag can mask
        if (cache is not None and seg.t == 1 and not seg.fresh and real is None and plain
                and native.decode_usable(cache.k, dtype)):
            rows, starts, _ = seg.host()  # decode on a CPU: each row's own columns, no masks or runs
            ends = torch.tensor([min(s0 + 1, cache.cols) for s0 in starts])
            return StageContext(cache, {}, rope, None, lora, decode=(torch.tensor(rows), ends))
        keys = torch.arange(kv, device=pos.device)
        masks = {}
        for window in self.windows if real is None else ():  # a padded layout: (b, t) masks
            if seg.fresh and not window and plain:
                continue  # a plain causal layout: no mask, the attention kernel's own causal masking
            mask = keys[None, None, :] <= pos[:, :, None]  # (b, t, kv): fresh rows start at 0
            if window:
                mask = mask & (keys[None, None, :] > pos[:, :, None] - window)
            mask = mask[:, None]  # (b, 1, t, kv)
            if slopes is not None:
                bias = slopes[None, :, None, None] * keys.float()[None, None, None, :]  # (1, h, 1, kv)
                mask = torch.where(mask, bias, torch.tensor(float("-inf"))).to(dtype)
            masks[window] = mask
        runs = None
        if cache is not None and not seg.fresh and real is None:  # rows reading the cache: columns each needs
            rows, starts, _ = seg.host()
            cell = 2 * self.spec.num_kv_heads * cache.k.shape[-1] * cache.k.element_size()
            runs = kv_runs(rows, [s0 + seg.t for s0 in starts], kv, cell, pos.device.type)
            runs = None if runs is None else [(i, j, rows[i], n) for i, j, n in runs]  # + the first cache row
        packed = None if real is None else packed_layout(seg, pos.device, dtype, self.spec.head_dim, plain)
        spans, cells, row_keys = (None, None, None) if real is None else row_layout(
            seg, real, keys, self.windows if packed is None else [], slopes, bool(self.spec.attn_softcap), dtype)
        return StageContext(cache, masks, rope, slopes, lora, real, runs=runs, spans=spans, real_cells=cells,
                            row_keys=row_keys, packed=packed)

    def forward(self, x: torch.Tensor, seg: Segment, cache: KVCache | None) -> torch.Tensor:
        """ids (b, t) on the first stage, hidden (b, t, hidden) elsewhere -> hidden (b, t, hidden)."""
        if self.embed is not None:
            x = self.embed_tokens(x, seg.positions)
        ctx = self.context(seg, cache, x.dtype)
        b, t = seg.rows.shape[0], seg.t
        if ctx.real is not None:  # the layers see only the real tokens (the projections' rows)
            x = x.reshape(b * t, -1).index_select(0, ctx.real)
        for i, layer in enumerate(self.layers):
            x = layer(x, seg, ctx, i)
        if ctx.real is not None:  # padding positions out: zeros (nothing reads them)
            x = x.new_zeros(b * t, x.shape[-1]).index_copy_(0, ctx.real, x).view(b, t, -1)
        return x

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """hidden (..., hidden) -> float32 logits (..., vocab)."""
        return map_rows(self._head, h, self.row_tile)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        if self.final_norm is not None:
            h = self.final_norm._norm(h)  # already inside a tile when tiling
        if self.proj_out is not None:
            h = self.proj_out(h)
        if getattr(self.lm_head, "prepacked", False):  # a float32 head in oneDNN's layout (kernels.packed)
            logits = self.lm_head(h.float())
        else:
            logits = float32_linear(h, self.lm_head.weight, self.lm_head.bias,  # accumulated and kept in float32
                                    fixed_linear if self.row_tile else F.linear)
        cap = self.spec.final_softcap
        return torch.tanh(logits / cap) * cap if cap else logits
