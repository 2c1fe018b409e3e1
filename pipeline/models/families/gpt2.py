"""GPT-2: learned positions, LayerNorm, GELU (tanh), Conv1D weights stored transposed, tied head.

HF GPT-2 keeps its projections as ``Conv1D`` with weights of shape (in, out); we transpose them
into ``nn.Linear`` layout. ``c_attn`` is fused [q; k; v] along the out dim, which is our layout.
The attention-scale options fold into the query rows: ``scale_attn_weights=False`` (no 1/sqrt(d))
multiplies q by sqrt(head_dim) to cancel SDPA's scale, ``scale_attn_by_inverse_layer_idx`` divides
layer i's q by i + 1. ``reorder_and_upcast_attn`` only changes the order of float32 operations
(same math), so it needs nothing here.
"""

from __future__ import annotations

import math

import torch

from pipeline.models.families import DecoderSpec, Source, activation_name, by_module, config_value, layernorm_decoder

MODEL_TYPES = ("gpt2",)

_P = "transformer."


def to_spec(cfg: dict) -> DecoderSpec:
    hidden = config_value(cfg, "n_embd", "hidden_size")
    heads = config_value(cfg, "n_head", "num_attention_heads")
    if hidden % heads:
        raise ValueError(f"GPT-2 config: n_embd {hidden} is not a multiple of n_head {heads}")
    return layernorm_decoder(
        cfg, "gpt2", hidden, heads,
        num_layers=config_value(cfg, "n_layer", "num_hidden_layers"),
        intermediate_size=config_value(cfg, "n_inner", default=4 * hidden),
        max_positions=config_value(cfg, "n_positions", "max_position_embeddings", "n_ctx", default=1024),
        norm_eps=config_value(cfg, "layer_norm_epsilon", default=1e-5),
        position="learned",
        activation=activation_name(cfg.get("activation_function", "gelu_new")),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        extra={"scale_attn_weights": bool(cfg.get("scale_attn_weights", True)),
               "scale_by_layer": bool(cfg.get("scale_attn_by_inverse_layer_idx", False))},
    )


def _t(ts: list[torch.Tensor]) -> torch.Tensor:
    """Conv1D (in, out) -> Linear (out, in); biases pass through."""
    return ts[0].t() if ts[0].dim() == 2 else ts[0]


def _qkv(spec: DecoderSpec, i: int):
    """c_attn -> our qkv, with GPT-2's non-default attention scales folded into the query rows."""
    scale = 1.0 if spec.extra.get("scale_attn_weights", True) else math.sqrt(spec.head_dim)
    if spec.extra.get("scale_by_layer", False):
        scale /= i + 1

    def combine(ts: list[torch.Tensor]) -> torch.Tensor:
        w = _t(ts)
        if scale != 1.0:
            w = w.clone()
            w[: spec.q_dim] *= scale
        return w

    return combine


def layer_source(spec: DecoderSpec, i: int, name: str) -> Source:
    p = f"{_P}h.{i}."
    if name.startswith("attn.qkv."):
        return by_module(p, {"attn.qkv": "attn.c_attn"}, name, _qkv(spec, i))
    table = {"n1": "ln_1", "n2": "ln_2", "attn.o": "attn.c_proj", "mlp.up": "mlp.c_fc", "mlp.down": "mlp.c_proj"}
    return by_module(p, table, name, _t)


def top_source(spec: DecoderSpec, name: str) -> Source:
    table = {"embed": _P + "wte", "lm_head": "lm_head", "pos_embed": _P + "wpe", "final_norm": _P + "ln_f"}
    return by_module("", table, name)
