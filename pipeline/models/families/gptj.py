"""GPT-J: parallel residual with one shared LayerNorm (``ln_1``), interleaved partial rotary
(rotate-every-two over ``rotary_dim`` dims), q/k/v/out without bias, MLP and lm_head with bias."""

from __future__ import annotations

from pipeline.models.families import DecoderSpec, RopeSpec, Source, activation_name, by_module, layernorm_decoder

MODEL_TYPES = ("gptj",)


def to_spec(cfg: dict) -> DecoderSpec:
    hidden = cfg.get("n_embd", cfg.get("hidden_size"))
    heads = cfg.get("n_head", cfg.get("num_attention_heads"))
    head_dim = hidden // heads
    return layernorm_decoder(
        cfg, "gptj", hidden, heads,
        num_layers=cfg.get("n_layer", cfg.get("num_hidden_layers")),
        intermediate_size=cfg.get("n_inner") or 4 * hidden,
        max_positions=cfg.get("n_positions", cfg.get("max_position_embeddings", 2048)),
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
        position="rope",
        # HF hard-codes base 10000 for GPT-J's sinusoids; rotary_dim None means the whole head
        rope=RopeSpec(theta=10000.0, rotary_dim=cfg.get("rotary_dim") or head_dim, interleaved=True),
        activation=activation_name(cfg.get("activation_function", "gelu_new")),
        mlp_bias=True,
        parallel_residual=True,
        shared_norm=True,
        lm_head_bias=True,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def layer_source(spec: DecoderSpec, i: int, name: str) -> Source:
    table = {"n1": "ln_1", "attn.qkv": [f"attn.{x}_proj" for x in "qkv"], "attn.o": "attn.out_proj",
             "mlp.up": "mlp.fc_in", "mlp.down": "mlp.fc_out"}
    return by_module(f"transformer.h.{i}.", table, name)


def top_source(spec: DecoderSpec, name: str) -> Source:
    return by_module("", {"embed": "transformer.wte", "final_norm": "transformer.ln_f", "lm_head": "lm_head"}, name)
