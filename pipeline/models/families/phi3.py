"""Phi-3, Phi-3.5 and Phi-4 (``phi3``): Llama's block with fused ``qkv_proj`` and ``gate_up_proj``
([gate; up], our layout), partial rotary where configured, ``longrope`` scaling (short factors for
a row whose prompt fits ``original_max_position_embeddings``, long ones otherwise) and a sliding
window on every layer when ``sliding_window`` is set.
"""

from __future__ import annotations

from pipeline.models.families.llama import top_source  # noqa: F401 (same embedding / norm / head names)
from pipeline.models.families import DecoderSpec, Source, by_module, layer_kinds, rotary_decoder

MODEL_TYPES = ("phi3",)
_LAYER = {"n1": "input_layernorm", "n2": "post_attention_layernorm", "attn.qkv": "self_attn.qkv_proj",
          "attn.o": "self_attn.o_proj", "mlp.up": "mlp.gate_up_proj", "mlp.down": "mlp.down_proj"}


def to_spec(cfg: dict) -> DecoderSpec:
    kinds, window = layer_kinds(cfg, cfg["num_hidden_layers"], lambda i: True)
    return rotary_decoder(cfg, "phi3", max_positions=4096, norm_eps=1e-5, layer_kinds=kinds, sliding_window=window)


def layer_source(spec: DecoderSpec, i: int, name: str) -> Source:
    return by_module(f"model.layers.{i}.", _LAYER, name)
