"""Model families: HF config.json -> DecoderSpec, and which HF tensors fill each stage parameter.

A family module defines ``MODEL_TYPES`` (HF ``model_type`` values it reads), optionally ``ALIASES``
(extra ``--model-type`` spellings, e.g. the seed's ``gptneox``), ``to_spec(cfg) -> DecoderSpec``,
``layer_source(spec, i, name) -> Source`` for parameter ``name`` of global layer ``i`` and
``top_source(spec, name) -> Source`` for embedding/head parameters (an untied head's: a tied head is the
embedding's table, ``embed.weight``'s source). The loader walks a stage's
parameters and asks the family where each one comes from, so a stage reads only its own tensors.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from pipeline.models.spec import DecoderSpec, MoESpec, RopeSpec

# family module name -> imported lazily so a broken family cannot break the others
_FAMILY_MODULES = ["llama", "gemma", "phi3", "olmo2", "moe_families", "opt", "bloom", "gpt2", "gpt_neox", "gptj",
                  "falcon"]


@dataclass
class Source:
    """HF tensor names that make one of our parameters, and how to combine them.

    ``fallback`` is another checkpoint layout of the same parameter, used when this one's tensors
    are not all stored (e.g. MoE experts saved one tensor per expert or fused into one 3-D tensor).
    """

    names: list[str]
    combine: Callable[[list[torch.Tensor]], torch.Tensor] = field(default=lambda ts: ts[0])
    fallback: Source | None = None

    def layouts(self) -> list[Source]:
        """This source and its fallbacks, in the order to try them."""
        return [self] + (self.fallback.layouts() if self.fallback else [])


def cat0(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts, dim=0)


def per_head_to_qkv(heads: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """Fused rows laid out [heads, 3, head_dim] (BLOOM, NeoX, Falcon without multi-query) -> our [q; k; v]."""

    def combine(ts: list[torch.Tensor]) -> torch.Tensor:
        w = ts[0]
        rest = w.shape[1:]
        return w.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(w.shape)

    return combine


def stack0(ts: list[torch.Tensor]) -> torch.Tensor:
    """Per-expert tensors -> one (experts, ...) tensor."""
    return torch.stack(ts)


def stack_pairs(ts: list[torch.Tensor]) -> torch.Tensor:
    """[gate_0, up_0, gate_1, up_1, ...] (I, H) each -> (experts, 2I, H), each expert's gate rows first."""
    shape = ts[0].shape
    if any(t.shape != shape for t in ts):
        raise RuntimeError(f"expert tensors of different shapes: {sorted({tuple(t.shape) for t in ts})}")
    out = ts[0].new_empty(len(ts) // 2, 2 * shape[0], *shape[1:])
    for j, t in enumerate(ts):  # straight into place: no per-expert temporaries
        out[j // 2, (j % 2) * shape[0] : (j % 2 + 1) * shape[0]] = t
    return out


def by_module(prefix: str, table: dict[str, str | list[str]], name: str, combine=None) -> Source:
    """Parameter ``name`` (``module.weight`` / ``module.bias``) from the HF module ``table[module]`` under
    ``prefix``, the same kind; a list of modules: their tensors concatenated (``cat0``, [q; k; v] or
    [gate; up]). ``combine``: a single tensor's conversion instead of the default (as is)."""
    module, kind = name.rsplit(".", 1)
    hf = table[module]
    if isinstance(hf, list):
        return Source([f"{prefix}{h}.{kind}" for h in hf], cat0)
    return Source([f"{prefix}{hf}.{kind}"]) if combine is None else Source([f"{prefix}{hf}.{kind}"], combine)


def config_value(cfg: dict, *keys: str, default=None):
    """The first of ``keys`` present in a config (families spell sizes differently: n_embd,
    hidden_size, n_embed...); ``default`` if none is, else a ValueError naming them."""
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    if default is None:
        raise ValueError(f"{cfg.get('model_type', 'model')} config has none of {keys}")
    return default


def activation_name(hf_act: str) -> str:
    table = {"silu": "silu", "swish": "silu", "gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh",
             "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
    if hf_act not in table:
        raise ValueError(f"unsupported activation {hf_act!r}; supported: {sorted(table)}")
    return table[hf_act]


def rope_from_config(cfg: dict, head_dim: int, rotary_dim: int | None = None, interleaved: bool = False,
                     params: dict | None = None) -> RopeSpec:
    """Read rope settings from transformers 5 ``rope_parameters`` or 4.x ``rope_theta``/``rope_scaling``
    (``params``: one layer type's entry of a per-layer-type ``rope_parameters``, as Gemma 3 has)."""
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.update(cfg.get("rope_parameters") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    kind = {"su": "longrope"}.get(kind, kind)  # Phi-3's early name
    if kind not in ("default", "linear", "llama3", "longrope"):
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: default, linear, llama3, longrope); "
                         "--backend transformers runs it through transformers' own rotary code")
    if rotary_dim is None:
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    fallback = cfg.get("max_position_embeddings", 2048) if kind == "longrope" else 8192  # llama3's default
    original = int(params.get("original_max_position_embeddings",
                              cfg.get("original_max_position_embeddings") or fallback))
    factor = params.get("factor")
    attention_factor = 1.0
    if kind == "longrope":  # HF: factor defaults to the context extension, attention factor from it
        if factor is None:
            factor = cfg.get("max_position_embeddings", original) / original
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeSpec(
        theta=float(theta), rotary_dim=rotary_dim, interleaved=interleaved, scaling_type=kind,
        factor=float(1.0 if factor is None else factor), low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)), original_max_position=original,
        short_factor=tuple(params.get("short_factor") or ()), long_factor=tuple(params.get("long_factor") or ()),
        attention_factor=float(attention_factor),
    )


def rotary_decoder(cfg: dict, family: str, max_positions: int = 2048, norm_eps: float = 1e-6, **fields) -> DecoderSpec:
    """The spec of a Llama-shaped decoder (RMSNorm, rotary, grouped-query attention, gated MLP) from its HF
    config: the sizes every such family reads alike (``max_positions`` and ``norm_eps``: its defaults where
    the config has none); ``fields``: what the family sets its own way (its ``rope`` and ``activation`` too)."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = fields.pop("rope", None) or rope_from_config(cfg, head_dim)
    activation = fields.pop("activation", None) or activation_name(cfg.get("hidden_act", "silu"))
    shape = dict(family=family, vocab_size=cfg["vocab_size"], hidden_size=hidden, num_layers=cfg["num_hidden_layers"],
                 num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
                 intermediate_size=cfg["intermediate_size"],
                 max_positions=cfg.get("max_position_embeddings", max_positions), norm="rms",
                 norm_eps=cfg.get("rms_norm_eps", norm_eps), position="rope", rope=rope, mlp="gated",
                 activation=activation, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    return DecoderSpec(**(shape | fields))


def layernorm_decoder(cfg: dict, family: str, hidden: int, heads: int, **fields) -> DecoderSpec:
    """The spec of a GPT-shaped decoder (LayerNorm with biases, a plain two-matrix MLP 4 x hidden wide,
    multi-head attention) from the sizes its HF config names its own way; ``fields``: the rest (layers,
    positions, biases, residual layout) and whatever the family sets otherwise."""
    shape = dict(family=family, vocab_size=cfg["vocab_size"], hidden_size=hidden, num_heads=heads, num_kv_heads=heads,
                 head_dim=hidden // heads, intermediate_size=4 * hidden, norm="layer", norm_bias=True, mlp="plain")
    return DecoderSpec(**(shape | fields))


def layer_kinds(cfg: dict, num_layers: int, default: Callable[[int], bool] | None = None) -> tuple[tuple[str, ...], int]:
    """(per-layer "full" / "sliding", sliding window) from a config's ``layer_types`` (transformers 5
    writes it) or, for configs without it, ``default(i)`` telling whether layer ``i`` slides."""
    window = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"config has {len(types)} layer_types for {num_layers} layers")
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} are not supported natively "
                             "(supported: full_attention, sliding_attention); try --backend transformers")
        kinds = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
    else:
        kinds = tuple("sliding" if default is not None and default(i) else "full" for i in range(num_layers))
    if not window or "sliding" not in kinds:
        return (), 0
    return kinds, window


def _families() -> list:
    return [importlib.import_module(f"{__name__}.{name}") for name in _FAMILY_MODULES]


def supported_model_types() -> list[str]:
    """Every spelling --model-type accepts (HF model_type values and the seed's aliases)."""
    names = set()
    for mod in _families():
        names.update(mod.MODEL_TYPES)
        names.update(getattr(mod, "ALIASES", ()))
    return sorted(names)


def family_for(cfg: dict, model_type: str | None = None):
    """The family module for a config (or an explicit --model-type)."""
    wanted = model_type or cfg.get("model_type")
    for mod in _families():
        if wanted in mod.MODEL_TYPES or wanted in getattr(mod, "ALIASES", ()):
            return mod
    raise ValueError(
        f"unsupported model type {wanted!r} (architectures: {cfg.get('architectures')}); "
        f"supported: {', '.join(supported_model_types())}"
    )


def spec_from_config(cfg: dict, model_type: str | None = None) -> DecoderSpec:
    return family_for(cfg, model_type).to_spec(cfg)


def parameter_sources(family, spec: DecoderSpec, model: torch.nn.Module) -> dict[str, Source]:
    """Map every parameter of a StageModel to the HF tensors it is made from."""
    out = {}
    for name, _ in model.named_parameters():
        if name.startswith("layers."):
            _, local, rest = name.split(".", 2)
            out[name] = family.layer_source(spec, model.first + int(local), rest)
        else:
            tied = name == "lm_head.weight" and spec.tie_embeddings
            out[name] = family.top_source(spec, "embed.weight" if tied else name)
    return out


__all__ = ["DecoderSpec", "MoESpec", "RopeSpec", "Source", "by_module", "cat0", "per_head_to_qkv", "stack0",
           "stack_pairs", "activation_name", "config_value", "rope_from_config", "layer_kinds", "layernorm_decoder",
           "rotary_decoder", "family_for", "spec_from_config", "supported_model_types", "parameter_sources"]
