"""Gemma, Gemma 2 and Gemma 3 (text): RMSNorm scaled by (1 + weight), embeddings times
sqrt(hidden_size), GeGLU (tanh GELU), tied head.

- Gemma 2 adds norms after attention and after the MLP (four per layer), the softmax scale
  ``query_pre_attn_scalar ** -0.5``, tanh soft-capping of attention scores and of the final logits,
  and sliding-window layers alternating with full ones.
- Gemma 3 (``gemma3_text``, what ``Gemma3ForCausalLM`` saves) drops the soft-capping, adds an RMSNorm
  over each head's queries and keys, and gives its local (sliding) and global layers their own
  rotary bases (``rope_parameters`` per layer type, or 4.x ``rope_local_base_freq``).
- Gemma 3 4B and larger ship as image-text checkpoints (``gemma3``): their ``text_config`` and the
  ``language_model.`` tensors run as text-only Gemma 3; the vision tower is never read.
"""

from __future__ import annotations

from pipeline.models.families.llama import layer_source, top_source  # noqa: F401 (Llama's tensor names)
from pipeline.models.families import DecoderSpec, activation_name, layer_kinds, rope_from_config, rotary_decoder

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text", "gemma3")


def _ropes(cfg: dict, head_dim: int):
    """(global rope, local rope or None)."""
    params = cfg.get("rope_parameters") or {}
    if cfg["model_type"] != "gemma3_text":
        return rope_from_config(cfg, head_dim), None
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5: one entry per layer type
        full = params.get("full_attention") or {"rope_theta": 1_000_000.0}
        local = params.get("sliding_attention") or {"rope_theta": 10_000.0}
    else:  # 4.x: rope_theta / rope_scaling for the global layers, rope_local_base_freq for the local ones
        full = {"rope_theta": cfg.get("rope_theta") or 1_000_000.0, **(cfg.get("rope_scaling") or {})}
        local = {"rope_theta": cfg.get("rope_local_base_freq") or 10_000.0}
    return rope_from_config(cfg, head_dim, params=full), rope_from_config(cfg, head_dim, params=local)


def _text_config(cfg: dict) -> dict:
    """The full text config of an image-text Gemma 3: hub configs list only what differs from
    transformers' defaults (heads, head_dim, vocab... are left out), so fill them in from there."""
    from transformers import Gemma3TextConfig

    text = {k: v for k, v in (cfg.get("text_config") or {}).items() if k != "model_type"}
    return {**Gemma3TextConfig(**text).to_dict(), "model_type": "gemma3_text"}


def to_spec(cfg: dict) -> DecoderSpec:
    if cfg["model_type"] == "gemma3":  # image-text checkpoint: its text decoder
        cfg = _text_config(cfg)
    kind = cfg["model_type"]
    hidden, heads, n = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // heads
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    act = "gelu_tanh" if act == "gelu" else activation_name(act)  # "gelu" in Gemma configs means the tanh one
    rope, local_rope = _ropes(cfg, head_dim)
    kinds, window = (), 0
    if kind == "gemma2":
        kinds, window = layer_kinds(cfg, n, lambda i: (i + 1) % 2 == 1)
    elif kind == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern") or 6
        kinds, window = layer_kinds(cfg, n, lambda i: (i + 1) % pattern != 0)
        if not kinds:  # every layer full: the local rotary base is never used
            local_rope = None
    scalar = cfg.get("query_pre_attn_scalar") if kind != "gemma" else None
    bias = bool(cfg.get("attention_bias", False))
    return rotary_decoder(
        cfg, kind, max_positions=8192,
        norm_offset=1.0,
        rope=rope,
        local_rope=local_rope,
        activation=act,
        qkv_bias=bias,
        o_bias=bias,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        embed_scale=hidden**0.5,
        post_branch_norm=kind != "gemma",
        qk_norm="head" if kind == "gemma3_text" else "",
        attn_scale=float(scalar) ** -0.5 if scalar else 0.0,
        attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0) if kind == "gemma2" else 0.0,
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0) if kind != "gemma" else 0.0,
        layer_kinds=kinds,
        sliding_window=window,
    )
