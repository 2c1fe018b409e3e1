"""BLOOM: ALiBi, LayerNorm right after the word embedding, fused per-head qkv, tanh GELU, tied head."""

from __future__ import annotations

from pipeline.models.families import (DecoderSpec, Source, activation_name, by_module, config_value,
                                      layernorm_decoder, per_head_to_qkv)

MODEL_TYPES = ("bloom",)

_P = "transformer."


def to_spec(cfg: dict) -> DecoderSpec:
    if cfg.get("apply_residual_connection_post_layernorm", False):
        raise ValueError(
            "BLOOM with apply_residual_connection_post_layernorm=True (residual taken after the layer norm) "
            "is not supported; only the standard pre-norm residual (False, every released BLOOM) is"
        )
    hidden = config_value(cfg, "hidden_size", "n_embed")
    heads = config_value(cfg, "n_head", "num_attention_heads")
    if hidden % heads:
        raise ValueError(f"BLOOM config: hidden_size {hidden} is not a multiple of n_head {heads}")
    return layernorm_decoder(
        cfg, "bloom", hidden, heads,
        num_layers=config_value(cfg, "n_layer", "num_hidden_layers"),
        # ALiBi has no table; this only caps prompt + max_tokens (BLOOM trained on 2048 tokens)
        max_positions=config_value(cfg, "max_position_embeddings", "seq_length", default=2048),
        norm_eps=config_value(cfg, "layer_norm_epsilon", default=1e-5),
        position="alibi",
        activation=activation_name("gelu_fast"),  # BloomGelu: tanh approximation
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        embed_norm=True,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def layer_source(spec: DecoderSpec, i: int, name: str) -> Source:
    p = f"{_P}h.{i}."
    if name.startswith("attn.qkv."):
        return by_module(p, {"attn.qkv": "self_attention.query_key_value"}, name, per_head_to_qkv(spec.num_heads))
    table = {"n1": "input_layernorm", "n2": "post_attention_layernorm", "attn.o": "self_attention.dense",
             "mlp.up": "mlp.dense_h_to_4h", "mlp.down": "mlp.dense_4h_to_h"}
    return by_module(p, table, name)


def top_source(spec: DecoderSpec, name: str) -> Source:
    table = {"embed": _P + "word_embeddings", "embed_norm": _P + "word_embeddings_layernorm",
             "final_norm": _P + "ln_f", "lm_head": "lm_head"}
    return by_module("", table, name)
