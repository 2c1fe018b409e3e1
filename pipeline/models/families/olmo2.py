"""OLMo 2 (``olmo2``): Llama's attention and SwiGLU with the norms moved onto the branch outputs
(x + norm(attn(x)), x + norm(mlp(x)); no input norms) and RMSNorms over the whole query and key
projections before rotary. RMSNorms multiply by their weight in float32, then cast.
"""

from __future__ import annotations

from pipeline.models.families.llama import top_source  # noqa: F401 (same embedding / norm / head names)
from pipeline.models.families import DecoderSpec, Source, llama, rotary_decoder

MODEL_TYPES = ("olmo2",)


def to_spec(cfg: dict) -> DecoderSpec:
    bias = bool(cfg.get("attention_bias", False))
    return rotary_decoder(
        cfg, "olmo2", max_positions=4096,
        norm_scale_fp32=True,
        qkv_bias=bias,
        o_bias=bias,
        pre_norm=False,
        post_branch_norm=True,
        qk_norm="full",
    )


def layer_source(spec: DecoderSpec, i: int, name: str) -> Source:
    """Llama's names (pipeline.models.families.llama) for attention and MLP; the norms on the branch outputs."""
    p = f"model.layers.{i}."
    norms = {"post_attn_norm.weight": Source([p + "post_attention_layernorm.weight"]),
             "post_mlp_norm.weight": Source([p + "post_feedforward_layernorm.weight"])}
    return norms[name] if name in norms else llama.layer_source(spec, i, name)
