"""OPT (125m .. 66b): learned positions offset by 2, ReLU MLP, biases, LayerNorm, tied lm_head.

Two block layouts: ``do_layer_norm_before`` True (pre-norm, final LayerNorm; every OPT except 350m)
and False (OPT-350m: post-norm residual blocks, no final LayerNorm). When ``word_embed_proj_dim``
differs from ``hidden_size`` (350m: 512 vs 1024) the word embeddings are projected in and the last
hidden state is projected back out before the tied head.
"""

from __future__ import annotations

import torch

from pipeline.models.families import DecoderSpec, Source, activation_name, by_module, layernorm_decoder

MODEL_TYPES = ("opt",)

_P = "model.decoder."


def to_spec(cfg: dict) -> DecoderSpec:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if hidden % heads:
        raise ValueError(f"OPT config: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    proj = cfg.get("word_embed_proj_dim") or hidden
    pre_norm = bool(cfg.get("do_layer_norm_before", True))
    bias = bool(cfg.get("enable_bias", True))
    affine = bool(cfg.get("layer_norm_elementwise_affine", True))
    return layernorm_decoder(
        cfg, "opt", hidden, heads,
        num_layers=cfg["num_hidden_layers"],
        intermediate_size=cfg["ffn_dim"],
        max_positions=cfg.get("max_position_embeddings", 2048),
        norm_eps=1e-5,  # nn.LayerNorm default; OPT has no config field for it
        position="learned",
        learned_pos_offset=2,
        activation=activation_name(cfg.get("activation_function", "relu")),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        pre_norm=pre_norm,
        final_norm=pre_norm and not cfg.get("_remove_final_layer_norm", False),
        embed_dim=proj if proj != hidden else 0,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        extra={"norm_affine": affine},  # without elementwise affine the norms get weight 1, bias 0 (see _norm)
    )


def _norm(spec: DecoderSpec, hf: str, kind: str) -> Source:
    """A LayerNorm parameter; OPT built with layer_norm_elementwise_affine=False stores none."""
    if spec.extra.get("norm_affine", True):
        return Source([f"{hf}.{kind}"])
    fill = torch.ones if kind == "weight" else torch.zeros
    return Source([], lambda ts: fill(spec.hidden_size))


def layer_source(spec: DecoderSpec, i: int, name: str) -> Source:
    p = f"{_P}layers.{i}."
    module, kind = name.rsplit(".", 1)
    if module in ("n1", "n2"):
        return _norm(spec, p + ("self_attn_layer_norm" if module == "n1" else "final_layer_norm"), kind)
    table = {"attn.qkv": [f"self_attn.{x}_proj" for x in "qkv"], "attn.o": "self_attn.out_proj", "mlp.up": "fc1",
             "mlp.down": "fc2"}
    return by_module(p, table, name)


def top_source(spec: DecoderSpec, name: str) -> Source:
    if name.startswith("final_norm."):
        return _norm(spec, _P + "final_layer_norm", name.split(".", 1)[1])
    table = {"embed": _P + "embed_tokens", "lm_head": "lm_head", "pos_embed": _P + "embed_positions",
             "proj_in": _P + "project_in", "proj_out": _P + "project_out"}
    return by_module("", table, name)
