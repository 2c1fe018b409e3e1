"""The generic stage: any decoder-only HF ``*ForCausalLM`` run with transformers' own decoder layers.

A stage instantiates the HF CausalLM class on the meta device, keeps only its own modules (embedding,
layers ``first..last-1`` with their global ``layer_idx``, final norm and ``lm_head``) and keeps
:class:`~pipeline.models.decoder.StageModel`'s contract: the runner's preallocated KV cache
(:class:`HFKVCache`, seen by attention as a transformers ``Cache``: :func:`segment_cache_class`),
per-row positions through the model's own rotary module, 4-D causal masks (sliding windows per layer;
additive for eager attention), and what the HF forwards do outside the layers
(:func:`~pipeline.models.hf_forward.forward_extras`). Models that cannot run this way raise
:class:`UnsupportedModel` saying why.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import threading
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.models.decoder import Segment
from pipeline.models.hf_forward import UnsupportedModel, forward_extras
from pipeline.cache.kv_cache import zeroed
from pipeline.models.kernels.logits import float32_linear


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model (a :class:`DecoderSpec` has the same fields)."""

    family: str
    vocab_size: int
    num_layers: int
    max_positions: int
    kv_dim: int  # key (= value) features per token of one layer


def hf_config(cfg: dict, model_type: str | None = None):
    """transformers' config object for a config.json dict; UnsupportedModel if it cannot be a generic stage."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = model_type or cfg.get("model_type")
    values = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(kind, **values)
    except ValueError:  # its message lists every model type transformers has: name the close ones instead
        near = difflib.get_close_matches(kind or "", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, 3)
        raise UnsupportedModel(f"transformers {transformers.__version__} does not know model_type {kind!r} "
                               f"(architectures: {cfg.get('architectures')})"
                               + (f"; did you mean {' or '.join(near)}?" if near else
                                  "; name the family with --model-type (e.g. llama), or upgrade transformers")) from None
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{kind} is an encoder-decoder model; this runner runs decoder-only causal LMs")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModel(f"{kind} has no *ForCausalLM class in transformers {transformers.__version__}; "
                               "this runner runs decoder-only causal LMs")
    if config.get_text_config() is not config or getattr(config, "sub_configs", None):
        raise UnsupportedModel(f"{kind} is a multimodal model (its config has sub-configs "
                               f"{sorted(getattr(config, 'sub_configs', {}) or {})}); only token inputs are supported")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if _converted_at_load(config.model_type, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__):
        raise UnsupportedModel(f"transformers converts {kind}'s checkpoint tensors as it loads them (renamed, or "
                               "experts fused); the generic stage reads tensors under their module names, so it "
                               "cannot load this model")
    return config


def _converted_at_load(*keys: str) -> bool:
    """Whether transformers renames or reshapes this model's tensors at load (keyed by model_type or class)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers without load-time conversions
        return False
    return any(get_checkpoint_conversion_mapping(k) for k in keys)


def model_shape(cfg: dict, model_type: str | None = None) -> ModelShape:
    config = hf_config(cfg, model_type)
    return ModelShape(config.model_type, config.vocab_size, config.num_hidden_layers,
                      getattr(config, "max_position_embeddings", None) or 2048, kv_dim(config))


def kv_dim(config) -> int:
    """Key (= value) features per token of one layer of a transformers config."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


_META = threading.local()  # .on: this thread builds modules with their parameters on meta
_META_LOCK = threading.Lock()
_META_USERS: list = []  # the threads inside _parameters_on_meta, and the register_parameter it replaced


@contextlib.contextmanager
def _parameters_on_meta():
    """Build modules with their parameters on the meta device but buffers real (on the CPU): buffers
    such as an embedding scale are computed at construction and not saved in checkpoints. The patched
    ``nn.Module.register_parameter`` acts only on the threads inside (``--in-process`` stages load side
    by side)."""
    with _META_LOCK:
        if not _META_USERS:
            _META_USERS.append(nn.Module.register_parameter)
            nn.Module.register_parameter = _register_on_meta
        _META_USERS.append(threading.get_ident())
    _META.on = True
    try:
        yield
    finally:
        _META.on = False
        with _META_LOCK:
            _META_USERS.remove(threading.get_ident())
            if len(_META_USERS) == 1:
                nn.Module.register_parameter = _META_USERS.pop()


def _register_on_meta(module, name, param):
    if getattr(_META, "on", False) and param is not None and param.device.type != "meta":
        param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    _META_USERS[0](module, name, param)


class HFKVCache:
    """Preallocated keys/values of one micro-batch on one stage: per layer (rows, kv_heads, cols, head_dim).

    A layer's pair is allocated at its first update, from the shapes of the keys it gets (heads and
    head size are whatever the HF attention produces)."""

    def __init__(self, layers: int, rows: int, cols: int, dtype, device):
        self.rows, self.cols, self.dtype, self.device = rows, cols, dtype, device
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers

    def layer(self, i: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s keys and values; ``like`` (b, kv_heads, t, head_dim) gives their shape."""
        if self.k[i] is None:
            shape = (self.rows, like.shape[1], self.cols, like.shape[3])
            self.k[i] = zeroed(shape, like.dtype, self.device)
            self.v[i] = zeroed(shape, like.dtype, self.device)
        return self.k[i], self.v[i]

    def fork(self, src: int, dsts: list[int], ncols: int) -> None:
        """Copy row ``src``'s first ``ncols`` columns to ``dsts`` (best_of shares one prefill)."""
        idx = torch.tensor(dsts, device=self.device)
        for k, v in zip(self.k, self.v):
            if k is not None:
                k[idx, :, :ncols] = k[src : src + 1, :, :ncols].clone()  # as KVCache.fork: not a view of k
                v[idx, :, :ncols] = v[src : src + 1, :, :ncols].clone()


class _SegmentCacheMixin:
    """The transformers ``Cache`` attention sees for one segment: reads and writes the runner's cache."""

    def __init__(self, cache: HFKVCache, seg: Segment, first: int):
        super().__init__(layers=[])
        self.cache, self.seg, self.first = cache, seg, first
        self.cols = seg.positions.clamp(max=cache.cols - 1)  # (b, t)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """k, v (b, kv_heads, t, d) of global layer ``layer_idx`` -> the keys/values to attend to."""
        seg, layer = self.seg, layer_idx - self.first
        k_all, v_all = self.cache.layer(layer, key_states)
        k_all[seg.rows[:, None], :, self.cols] = key_states.transpose(1, 2)
        v_all[seg.rows[:, None], :, self.cols] = value_states.transpose(1, 2)
        if seg.fresh:
            return key_states, value_states
        sel = slice(None) if seg.all_rows else seg.rows
        return k_all[sel, :, : seg.kv_len], v_all[sel, :, : seg.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seg.kv_len


@functools.cache
def segment_cache_class() -> type:
    """SegmentCache: a subclass of transformers' ``Cache`` (imported on first use, not at planning)."""
    from transformers.cache_utils import Cache

    return type("SegmentCache", (_SegmentCacheMixin, Cache), {"__doc__": _SegmentCacheMixin.__doc__})


def _layer_kinds(config) -> list[str]:
    """'full' or 'sliding' per global layer, as transformers' masks would make them."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None:
        sliding = window is not None and getattr(config, "use_sliding_window", True) is not False
        return ["sliding" if sliding else "full"] * n
    table = {"full_attention": "full", "sliding_attention": "sliding"}
    unknown = sorted({t for t in types if t not in table})
    if unknown:
        raise UnsupportedModel(f"{config.model_type}: layer types {unknown} are not supported by the generic stage "
                               "(supported: full_attention, sliding_attention)")
    return [table[t] for t in types[:n]]


class HFStageModel(nn.Module):
    """embed? + layers[first:last] + (norm + lm_head)? of an HF causal LM, as transformers builds them.

    Same interface as :class:`~pipeline.models.decoder.StageModel`: ``model(x, seg, cache)``,
    :meth:`head`, :meth:`new_cache`; :meth:`checkpoint_names` tells the loader where each
    parameter comes from.
    """

    row_tile = 0  # --batch-invariant is refused for the generic stage

    def __init__(self, config, first: int, last: int, has_embed: bool, has_head: bool):
        super().__init__()
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        self.config, self.first, self.last = config, first, last
        self.has_embed, self.has_head = has_embed, has_head
        kind = config.model_type
        causal_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        with _parameters_on_meta():  # the whole model, but no memory: only our modules get real storage
            try:
                full = causal_cls._from_config(config, attn_implementation="sdpa")
            except ValueError:  # e.g. attention logit soft-capping: transformers' eager attention
                full = causal_cls._from_config(config, attn_implementation="eager")
        self.config = config = full.config
        self.additive_mask = config._attn_implementation == "eager"  # eager adds the mask to the scores
        base = getattr(full, full.base_model_prefix, None)
        layers = getattr(base, "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) != config.num_hidden_layers:
            raise UnsupportedModel(f"{kind}: {causal_cls.__name__} is not a plain decoder stack "
                                   f"({full.base_model_prefix}.layers with one module per layer)")
        rotary = getattr(base, "rotary_emb", None)
        if rotary is None:
            raise UnsupportedModel(f"{kind}: {type(base).__name__} has no rotary_emb module (learned or ALiBi "
                                   "positions are only supported by the native families)")
        attn = [m for m in layers.modules() if getattr(m, "is_causal", None) is not None]
        if any(m.is_causal is False for m in attn):
            raise UnsupportedModel(f"{kind}: its attention is bidirectional (is_causal=False); this runner runs "
                                   "causal LMs")
        embed_module = base.get_input_embeddings()
        others = [n for n, m in base.named_children() if n not in ("layers", "rotary_emb") and m is not embed_module
                  and not isinstance(m, nn.Dropout)]
        if len(others) != 1:
            raise UnsupportedModel(f"{kind}: {type(base).__name__} has modules {others} besides its embedding and "
                                   "decoder layers; the generic stage runs one final norm there")
        norm_name = others[0]
        embed_name = next((n for n, m in base.named_children() if m is embed_module), "embed_tokens")
        self.extras = forward_extras(full, base, config, norm_name, embed_name)
        self.kinds = _layer_kinds(config)
        self.window = getattr(config, "sliding_window", None)
        self._names = {id(m): n for n, m in full.named_modules(remove_duplicate=False)}
        self.embed = base.get_input_embeddings() if has_embed else None
        self.layers = nn.ModuleList(layers[first:last])
        self.norm = getattr(base, norm_name) if has_head else None
        self.lm_head = full.get_output_embeddings() if has_head else None
        if has_head and self.lm_head is None:
            raise UnsupportedModel(f"{kind}: {causal_cls.__name__} has no output embeddings (lm_head)")
        self.tied = has_head and self.lm_head.weight is embed_module.weight
        self._embed_name = self._names[id(embed_module)] + ".weight"
        self._rotary_cls = type(rotary)
        self._rotary_per_type = "layer_type" in inspect.signature(rotary.forward).parameters
        self._rotary_types = sorted(set(getattr(config, "layer_types", None) or [])) if self._rotary_per_type else []
        self.rotary = None  # built on the real device by init_buffers
        del full

    def checkpoint_names(self) -> dict[str, tuple[list[str], str]]:
        """Our parameter or persistent buffer name -> (HF names to try in order, part: 'layer'/'embs'/'head')."""
        out = {}
        for prefix, module, part in self._owned():
            hf = self._names[id(module)]
            for n, _ in module.named_parameters():
                out[f"{prefix}.{n}"] = ([f"{hf}.{n}"], part)
            for n, b in module.named_buffers():
                if n.split(".")[-1] not in module.get_submodule(".".join(n.split(".")[:-1]))._non_persistent_buffers_set:
                    out[f"{prefix}.{n}"] = ([f"{hf}.{n}"], part)
        if self.tied and self.embed is not None:
            del out["lm_head.weight"]  # shares the embedding table (:meth:`tie`)
        elif self.tied and "lm_head.weight" in out:
            out["lm_head.weight"] = ([self._embed_name, *out["lm_head.weight"][0]], "head")  # tied: saved once
        return out

    def _owned(self):
        if self.embed is not None:
            yield "embed", self.embed, "embs"
        for i, layer in enumerate(self.layers):
            yield f"layers.{i}", layer, "layer"
        if self.has_head:
            yield "norm", self.norm, "head"
            yield "lm_head", self.lm_head, "head"

    def materialize(self, device, dtype: torch.dtype) -> "HFStageModel":
        """Give our parameters (on meta so far) storage on ``device`` in ``dtype``, unfilled; buffers
        (computed at construction, on the CPU) move there too, floating ones in ``dtype``."""
        for module in self.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype
                                                                        if p.is_floating_point() else p.dtype),
                                                            requires_grad=False)
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = b.to(device, dtype if b.is_floating_point() else b.dtype)
        return self

    def init_buffers(self) -> None:
        """The rotary module on the real device, its tables in float32 as transformers keeps them."""
        device = next(self.parameters()).device
        with torch.device(device):
            self.rotary = self._rotary_cls(config=self.config)

    def tie(self) -> None:
        """Share the embedding table with lm_head when one stage holds both (after loading)."""
        if self.tied and self.embed is not None:
            self.lm_head.weight = self.embed.weight

    def new_cache(self, rows: int, cols: int) -> HFKVCache:
        p = next(self.parameters())
        return HFKVCache(len(self.layers), rows, cols, p.dtype, p.device)

    def masks(self, seg: Segment, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Boolean (b, 1, t, kv) masks per layer kind (additive in ``dtype`` for eager attention): key column j is visible to a query at position p
        when j <= p (and p - j < sliding_window for sliding layers); a row's positions are its columns."""
        pos = seg.positions  # (b, t)
        kv = seg.t if seg.fresh else seg.kv_len
        keys = torch.arange(kv, device=pos.device)[None, None, :]
        causal = keys <= pos[:, :, None]
        out = {"full": causal[:, None]}
        if "sliding" in self.kinds[self.first : self.last]:
            out["sliding"] = (causal & (keys > pos[:, :, None] - self.window))[:, None]
        if self.additive_mask:  # 0 where visible, the dtype's minimum elsewhere (as transformers makes them)
            low = torch.finfo(dtype).min
            out = {k: torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, low) for k, m in out.items()}
        return out

    def forward(self, x: torch.Tensor, seg: Segment, cache: HFKVCache | None) -> torch.Tensor:
        """ids (b, t) on the first stage, hidden (b, t, hidden) elsewhere -> hidden (b, t, hidden)."""
        if self.embed is not None:
            x = self.embed(x)
            if self.extras.embed_scale is not None:
                x = x * self.extras.embed_scale
        pos = seg.positions
        if self._rotary_per_type:
            rope = {t: self.rotary(x, pos, layer_type=t) for t in self._rotary_types}
        else:
            rope = self.rotary(x, pos)
        masks = self.masks(seg, x.dtype)
        past = segment_cache_class()(cache, seg, self.first) if cache is not None else None
        types = getattr(self.config, "layer_types", None)
        for i, layer in enumerate(self.layers):
            g = self.first + i
            out = layer(x, attention_mask=masks[self.kinds[g]], position_ids=pos, past_key_values=past,
                        use_cache=past is not None,
                        position_embeddings=rope[types[g]] if self._rotary_per_type else rope)
            x = out[0] if isinstance(out, tuple) else out
        return x

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """hidden (..., hidden) -> float32 logits (..., vocab), scaled as the HF model's forward does."""
        e = self.extras
        logits = float32_linear(self.norm(h), self.lm_head.weight, self.lm_head.bias)  # float32 accumulation
        if e.logits_divide is not None:
            logits = logits / e.logits_divide
        if e.logits_multiply is not None:
            logits = logits * e.logits_multiply
        if e.softcap is not None:
            logits = torch.tanh(logits / e.softcap) * e.softcap
        return logits


__all__ = ["HFKVCache", "HFStageModel", "ModelShape", "segment_cache_class", "UnsupportedModel", "forward_extras",
           "hf_config", "model_shape"]
