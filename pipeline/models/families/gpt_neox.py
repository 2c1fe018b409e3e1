"""GPT-NeoX (Pythia, GPT-NeoX-20B, RedPajama-INCITE): LayerNorm, partial rotary, parallel or
sequential residual, fused per-head ``query_key_value``, untied ``embed_out``."""

from __future__ import annotations

from pipeline.models.families import (DecoderSpec, Source, activation_name, by_module, layernorm_decoder,
                                      per_head_to_qkv, rope_from_config)

MODEL_TYPES = ("gpt_neox",)
ALIASES = ("gptneox",)  # the seed's --model-type spelling


def to_spec(cfg: dict) -> DecoderSpec:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = hidden // heads
    params = cfg.get("rope_parameters") or {}
    # transformers 5 writes rope_parameters; 4.x and the original checkpoints use rotary_pct/rotary_emb_base.
    # HF's default when neither is given is 0.25 (not 1.0 as for most families).
    pct = params.get("partial_rotary_factor", cfg.get("rotary_pct", cfg.get("partial_rotary_factor", 0.25)))
    rope_cfg = dict(cfg)
    if "rope_theta" not in params and "rope_theta" not in cfg:
        rope_cfg["rope_theta"] = cfg.get("rotary_emb_base", 10000.0)
    bias = bool(cfg.get("attention_bias", True))
    return layernorm_decoder(
        cfg, "gpt_neox", hidden, heads,
        num_layers=cfg["num_hidden_layers"],
        intermediate_size=cfg.get("intermediate_size") or 4 * hidden,
        max_positions=cfg.get("max_position_embeddings", 2048),
        norm_eps=cfg.get("layer_norm_eps", 1e-5),
        position="rope",
        rope=rope_from_config(rope_cfg, head_dim, rotary_dim=int(head_dim * pct)),
        activation=activation_name(cfg.get("hidden_act", "gelu")),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=True,
        parallel_residual=bool(cfg.get("use_parallel_residual", True)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def layer_source(spec: DecoderSpec, i: int, name: str) -> Source:
    p = f"gpt_neox.layers.{i}."
    if name.startswith("attn.qkv."):
        return by_module(p, {"attn.qkv": "attention.query_key_value"}, name, per_head_to_qkv(spec.num_heads))
    table = {"n1": "input_layernorm", "n2": "post_attention_layernorm", "attn.o": "attention.dense",
             "mlp.up": "mlp.dense_h_to_4h", "mlp.down": "mlp.dense_4h_to_h"}
    return by_module(p, table, name)


def top_source(spec: DecoderSpec, name: str) -> Source:
    table = {"embed": "gpt_neox.embed_in", "final_norm": "gpt_neox.final_layer_norm", "lm_head": "embed_out"}
    return by_module("", table, name)
