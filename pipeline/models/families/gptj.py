"""GPT-J: parallel residual with one shared LayerNorm (``ln_1``), interleaved partial rotary
(rotate-every-two over ``rotary_dim`` dims), q/k/v/out without bias, MLP and lm_head with bias."""

from __future__ import annotations

from pipeline.models.families import DecoderSpec, RopeSpec, Source, activation_name, cat0, layernorm_decoder

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
    p = f"transformer.h.{i}."
    return {
        "n1.weight": Source([p + "ln_1.weight"]),
        "n1.bias": Source([p + "ln_1.bias"]),
        "attn.qkv.weight": Source([p + f"attn.{x}_proj.weight" for x in "qkv"], cat0),
        "attn.o.weight": Source([p + "attn.out_proj.weight"]),
        "mlp.up.weight": Source([p + "mlp.fc_in.weight"]),
        "mlp.up.bias": Source([p + "mlp.fc_in.bias"]),
        "mlp.down.weight": Source([p + "mlp.fc_out.weight"]),
        "mlp.down.bias": Source([p + "mlp.fc_out.bias"]),
    }[name]


def top_source(spec: DecoderSpec, name: str) -> Source:
    return {
        "embed.weight": Source(["transformer.wte.weight"]),
        "final_norm.weight": Source(["transformer.ln_f.weight"]),
        "final_norm.bias": Source(["transformer.ln_f.bias"]),
        "lm_head.weight": Source(["lm_head.weight"]),
        "lm_head.bias": Source(["lm_head.bias"]),
    }[name]
