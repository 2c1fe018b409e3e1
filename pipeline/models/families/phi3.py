"""Phi-3, Phi-3.5 and Phi-4 (``phi3``): Llama's block with fused ``qkv_proj`` and ``gate_up_proj``
([gate; up], our layout), partial rotary where configured, ``longrope`` scaling (short factors for
a row whose prompt fits ``original_max_position_embeddings``, long ones otherwise) and a sliding
window on every layer when ``sliding_window`` is set.
"""

from __future__ import annotations

from pipeline.models.families.llama import top_source  # noqa: F401 (same embedding / norm / head names)
from pipeline.models.families import DecoderSpec, Source, layer_kinds, rotary_decoder

MODEL_TYPES = ("phi3",)


def to_spec(cfg: dict) -> DecoderSpec:
    kinds, window = layer_kinds(cfg, cfg["num_hidden_layers"], lambda i: True)
    return rotary_decoder(cfg, "phi3", max_positions=4096, norm_eps=1e-5, layer_kinds=kinds, sliding_window=window)


def layer_source(spec: DecoderSpec, i: int, name: str) -> Source:
    p = f"model.layers.{i}."
    return {
        "n1.weight": Source([p + "input_layernorm.weight"]),
        "n2.weight": Source([p + "post_attention_layernorm.weight"]),
        "attn.qkv.weight": Source([p + "self_attn.qkv_proj.weight"]),
        "attn.o.weight": Source([p + "self_attn.o_proj.weight"]),
        "mlp.up.weight": Source([p + "mlp.gate_up_proj.weight"]),
        "mlp.down.weight": Source([p + "mlp.down_proj.weight"]),
    }[name]
