"""OLMo 2 (``olmo2``): Llama's attention and SwiGLU with the norms moved onto the branch outputs
(x + norm(attn(x)), x + norm(mlp(x)); no input norms) and RMSNorms over the whole query and key
projections before rotary. RMSNorms multiply by their weight in float32, then cast.
"""

from __future__ import annotations

from pipeline.models.families.llama import top_source  # noqa: F401 (same embedding / norm / head names)
from pipeline.models.families import DecoderSpec, Source, activation_name, cat0, rope_from_config

MODEL_TYPES = ("olmo2",)
ALIASES = ()


def to_spec(cfg: dict) -> DecoderSpec:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    bias = bool(cfg.get("attention_bias", False))
    return DecoderSpec(
        family="olmo2",
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=cfg["intermediate_size"],
        max_positions=cfg.get("max_position_embeddings", 4096),
        norm="rms",
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        norm_scale_fp32=True,
        position="rope",
        rope=rope_from_config(cfg, head_dim),
        mlp="gated",
        activation=activation_name(cfg.get("hidden_act", "silu")),
        qkv_bias=bias,
        o_bias=bias,
        pre_norm=False,
        post_branch_norm=True,
        qk_norm="full",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def layer_source(spec: DecoderSpec, i: int, name: str) -> Source:
    p = f"model.layers.{i}."
    table = {
        "post_attn_norm.weight": Source([p + "post_attention_layernorm.weight"]),
        "post_mlp_norm.weight": Source([p + "post_feedforward_layernorm.weight"]),
        "attn.q_norm.weight": Source([p + "self_attn.q_norm.weight"]),
        "attn.k_norm.weight": Source([p + "self_attn.k_norm.weight"]),
        "attn.o.weight": Source([p + "self_attn.o_proj.weight"]),
        "attn.o.bias": Source([p + "self_attn.o_proj.bias"]),
        "mlp.up.weight": Source([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], cat0),
        "mlp.down.weight": Source([p + "mlp.down_proj.weight"]),
    }
    for kind in ("weight", "bias"):
        table[f"attn.qkv.{kind}"] = Source([p + f"self_attn.{x}_proj.{kind}" for x in "qkv"], cat0)
    return table[name]
