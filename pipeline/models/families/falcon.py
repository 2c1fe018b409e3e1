"""Falcon: LayerNorm, rotary, fused ``query_key_value`` in one of three layouts, biases per ``bias``.

* new decoder architecture (Falcon-40B/180B, Falcon2): parallel attention with ``ln_attn`` + ``ln_mlp``
  (or one ``input_layernorm`` if ``num_ln_in_parallel_attn`` is 1), ``num_kv_heads`` grouped KV heads,
  fused rows grouped per KV head as [kv_heads, q_per_kv + 2, head_dim] (the queries, then k, then v);
* Falcon-7B style: ``multi_query`` -> one KV head, fused rows [q heads..., k, v]; ``parallel_attn`` with one
  shared ``input_layernorm``, or sequential with ``input_layernorm`` + ``post_attention_layernorm``;
* neither: full multi-head attention with per-head rows [heads, 3, head_dim].

ALiBi variants (falcon-rw) are rejected: our ALiBi path is BLOOM's, not Falcon's.
"""

from __future__ import annotations

import torch

from pipeline.models.families import (DecoderSpec, Source, activation_name, by_module, layernorm_decoder,
                                      per_head_to_qkv, rope_from_config)

MODEL_TYPES = ("falcon",)


def _layout(cfg: dict) -> tuple[int, str]:
    """(KV heads, fused qkv layout: grouped | per_head | multi_query), as HF's FalconAttention reads them."""
    heads = cfg["num_attention_heads"]
    if cfg.get("new_decoder_architecture", False):
        return cfg.get("num_kv_heads") or heads, "grouped"
    if cfg.get("multi_query", True):
        return 1, "multi_query"
    return heads, "per_head"  # HF ignores num_kv_heads here: the fused rows hold every head's k and v


def to_spec(cfg: dict) -> DecoderSpec:
    if cfg.get("alibi", False):
        raise ValueError("Falcon with alibi=True (falcon-rw) is not supported; only rotary Falcon models are")
    hidden = cfg.get("hidden_size") or cfg["n_embed"]
    heads = cfg["num_attention_heads"]
    head_dim = hidden // heads
    new_arch = bool(cfg.get("new_decoder_architecture", False))
    parallel = bool(cfg.get("parallel_attn", True))
    if new_arch and not parallel:
        raise ValueError("Falcon config has new_decoder_architecture=True with parallel_attn=False, "
                         "which HF Falcon cannot run either; set parallel_attn to true")
    # two norms in parallel attention only for the new architecture (HF default 2 there)
    two_norms = new_arch and (cfg.get("num_ln_in_parallel_attn") or 2) == 2
    kv_heads, layout = _layout(cfg)
    bias = bool(cfg.get("bias", False))
    return layernorm_decoder(
        cfg, "falcon", hidden, heads,
        num_layers=cfg["num_hidden_layers"],
        num_kv_heads=kv_heads,
        intermediate_size=cfg.get("ffn_hidden_size") or 4 * hidden,
        max_positions=cfg.get("max_position_embeddings", 2048),
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        position="rope",
        rope=rope_from_config(cfg, head_dim, rotary_dim=head_dim),
        activation=activation_name(cfg.get("activation", "gelu")),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        parallel_residual=parallel,
        shared_norm=parallel and not two_norms,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        extra={"qkv_layout": layout},
    )


def _grouped_to_qkv(kv_heads: int, q_per_kv: int):
    """Rows [kv_heads, q_per_kv + 2, head_dim] -> our [q; k; v]; query head h uses kv head h // q_per_kv."""

    def combine(ts: list[torch.Tensor]) -> torch.Tensor:
        w = ts[0]
        rest = w.shape[1:]
        g = w.reshape(kv_heads, q_per_kv + 2, -1, *rest)
        q, k, v = g[:, :q_per_kv], g[:, q_per_kv], g[:, q_per_kv + 1]
        return torch.cat([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)], dim=0)

    return combine


def _qkv_combine(spec: DecoderSpec):
    layout = spec.extra["qkv_layout"]
    if layout == "grouped":
        return _grouped_to_qkv(spec.num_kv_heads, spec.num_heads // spec.num_kv_heads)
    if layout == "per_head":
        return per_head_to_qkv(spec.num_heads)
    return lambda ts: ts[0]  # multi_query: already [q heads; k; v]


def layer_source(spec: DecoderSpec, i: int, name: str) -> Source:
    p = f"transformer.h.{i}."
    if name.startswith("attn.qkv."):
        return by_module(p, {"attn.qkv": "self_attention.query_key_value"}, name, _qkv_combine(spec))
    if spec.parallel_residual and not spec.shared_norm:
        norms = {"n1": "ln_attn", "n2": "ln_mlp"}
    else:
        norms = {"n1": "input_layernorm", "n2": "post_attention_layernorm"}
    table = {**norms, "attn.o": "self_attention.dense", "mlp.up": "mlp.dense_h_to_4h",
             "mlp.down": "mlp.dense_4h_to_h"}
    return by_module(p, table, name)


def top_source(spec: DecoderSpec, name: str) -> Source:
    table = {"embed": "transformer.word_embeddings", "final_norm": "transformer.ln_f", "lm_head": "lm_head"}
    return by_module("", table, name)
