"""OLMo 2 (``olmo2``): Llama's attention and SwiGLU with the norms moved onto the branch outputs
(x + norm(attn(x)), x + norm(mlp(x)); no input norms) and RMSNorms over the whole query and key
projections before rotary. RMSNorms multiply by their weight in float32, then cast.
"""

from __future__ import annotations

from pipeline.models.families.llama import layer_source, top_source  # noqa: F401 (Llama's tensor names)
from pipeline.models.families import DecoderSpec, rotary_decoder

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
