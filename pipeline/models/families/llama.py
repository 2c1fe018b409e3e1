"""Llama 1/2/3, Mistral, Qwen2 and Qwen3: RMSNorm, rotary (linear / llama3 scaling), GQA, SwiGLU.

Qwen3 adds an RMSNorm over each head's queries and keys (before rotary) and sets ``head_dim``
independently of hidden / heads. Sliding windows: Mistral's apply to every layer; Qwen2/3 use one
only with ``use_sliding_window``, on the layers from ``max_window_layers`` on (or per ``layer_types``).
"""

from __future__ import annotations

from pipeline.models.families import DecoderSpec, Source, cat0, layer_kinds, rotary_decoder

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _sliding(cfg: dict) -> tuple[tuple[str, ...], int]:
    n = cfg["num_hidden_layers"]
    if cfg["model_type"] in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False):
            return (), 0
        return layer_kinds(cfg, n, lambda i: i >= cfg.get("max_window_layers", 28))
    if cfg["model_type"] == "mistral":
        return layer_kinds(cfg, n, lambda i: True)
    return (), 0


def to_spec(cfg: dict) -> DecoderSpec:
    attention_bias = bool(cfg.get("attention_bias", False))
    kinds, window = _sliding(cfg)
    return rotary_decoder(
        cfg, cfg["model_type"],
        qkv_bias=attention_bias or cfg["model_type"] == "qwen2",
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm="head" if cfg["model_type"] == "qwen3" else "",
        layer_kinds=kinds,
        sliding_window=window,
    )


def layer_source(spec: DecoderSpec, i: int, name: str) -> Source:
    p = f"model.layers.{i}."
    table = {
        "n1.weight": Source([p + "input_layernorm.weight"]),
        "n2.weight": Source([p + "post_attention_layernorm.weight"]),
        "attn.o.weight": Source([p + "self_attn.o_proj.weight"]),
        "attn.o.bias": Source([p + "self_attn.o_proj.bias"]),
        "mlp.up.weight": Source([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], cat0),
        "mlp.up.bias": Source([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"], cat0),
        "mlp.down.weight": Source([p + "mlp.down_proj.weight"]),
        "mlp.down.bias": Source([p + "mlp.down_proj.bias"]),
        "attn.q_norm.weight": Source([p + "self_attn.q_norm.weight"]),
        "attn.k_norm.weight": Source([p + "self_attn.k_norm.weight"]),
    }
    for kind in ("weight", "bias"):
        table[f"attn.qkv.{kind}"] = Source([p + f"self_attn.{x}_proj.{kind}" for x in "qkv"], cat0)
    return table[name]


def top_source(spec: DecoderSpec, name: str) -> Source:
    return {"embed.weight": Source(["model.embed_tokens.weight"]), "final_norm.weight": Source(["model.norm.weight"]),
            "lm_head.weight": Source(["lm_head.weight"])}[name]
