"""Llama 1/2/3, Mistral, Qwen2 and Qwen3: RMSNorm, rotary (linear / llama3 scaling), GQA, SwiGLU.

Qwen3 adds an RMSNorm over each head's queries and keys (before rotary) and sets ``head_dim``
independently of hidden / heads. Sliding windows: Mistral's apply to every layer; Qwen2/3 use one
only with ``use_sliding_window``, on the layers from ``max_window_layers`` on (or per ``layer_types``).
"""

from __future__ import annotations

from pipeline.models.families import DecoderSpec, Source, by_module, layer_kinds, rotary_decoder

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


_LAYER = {"n1": "input_layernorm", "n2": "post_attention_layernorm",
          "attn.qkv": [f"self_attn.{x}_proj" for x in "qkv"], "attn.o": "self_attn.o_proj",
          "mlp.up": ["mlp.gate_proj", "mlp.up_proj"], "mlp.down": "mlp.down_proj",
          "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm",
          "post_attn_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
# with norms on the branch outputs too (Gemma 2/3; OLMo 2 has no input norms) the pre-MLP norm is renamed
# (Gemma 1 keeps Llama's naming)
_BRANCH_NORMED = _LAYER | {"n2": "pre_feedforward_layernorm"}


def layer_source(spec: DecoderSpec, i: int, name: str) -> Source:
    return by_module(f"model.layers.{i}.", _BRANCH_NORMED if spec.post_branch_norm else _LAYER, name)


def top_source(spec: DecoderSpec, name: str) -> Source:
    return by_module("", {"embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}, name)
