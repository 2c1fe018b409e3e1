"""Mixtral, Qwen2-MoE and Qwen3-MoE: Llama-style attention with a mixture-of-experts MLP (:mod:`.moe`).

- Mixtral: every layer routes, top-2 of 8, softmax over all experts then renormalized over the chosen.
- Qwen2-MoE: qkv bias, a shared expert scaled by ``sigmoid(shared_expert_gate(x))``, ``norm_topk_prob``.
- Qwen3-MoE: per-head q/k RMSNorm, ``attention_bias``, ``norm_topk_prob``.
- Qwen2/3-MoE: ``decoder_sparse_step`` and ``mlp_only_layers`` leave some layers a dense MLP
  (``intermediate_size``); experts are ``moe_intermediate_size`` wide.

Expert tensors are read from either checkpoint layout: one tensor per expert (what
``save_pretrained`` writes and hub checkpoints carry: Mixtral ``block_sparse_moe.experts.{j}.w1/w3/w2``,
Qwen ``mlp.experts.{j}.gate_proj/up_proj/down_proj``) or fused 3-D tensors (transformers 5's
in-memory ``mlp.experts.gate_up_proj`` (E, 2I, H) / ``down_proj`` (E, H, I)). A stage reads only
the experts of its own layers.
"""

from __future__ import annotations

from dataclasses import replace

from pipeline.models.families.llama import top_source  # noqa: F401 (same embedding / norm / head names)
from pipeline.models.families import DecoderSpec, MoESpec, Source, cat0, config_value, llama, stack0, stack_pairs

MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
_DEFAULT_EXPERTS = {"mixtral": 8, "qwen2_moe": 60, "qwen3_moe": 128}  # transformers' config defaults


def to_spec(cfg: dict) -> DecoderSpec:
    kind = cfg["model_type"]
    dense = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}[kind]  # same attention, windows
    spec = replace(llama.to_spec({**cfg, "model_type": dense}), family=kind)
    if kind == "qwen2_moe":
        spec = replace(spec, qkv_bias=bool(cfg.get("qkv_bias", True)), o_bias=False)
    elif kind == "qwen3_moe":
        bias = bool(cfg.get("attention_bias", False))
        spec = replace(spec, qkv_bias=bias, o_bias=bias)
    experts = config_value(cfg, "num_local_experts", "num_experts", default=_DEFAULT_EXPERTS[kind])
    if not experts:  # Qwen MoE configs with num_experts 0: every layer is dense
        return spec
    if kind == "mixtral":
        moe = MoESpec(num_experts=experts, top_k=cfg.get("num_experts_per_tok", 2),
                      expert_size=cfg["intermediate_size"], norm_topk_prob=True, fp32_weights=True)
    else:
        moe = MoESpec(
            num_experts=experts,
            top_k=config_value(cfg, "num_experts_per_tok"),
            expert_size=config_value(cfg, "moe_intermediate_size"),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            shared_expert_size=(cfg.get("shared_expert_intermediate_size") or 0) if kind == "qwen2_moe" else 0,
            sparse_step=cfg.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        )
    return replace(spec, moe=moe)


def layer_source(spec: DecoderSpec, i: int, name: str) -> Source:
    p = f"model.layers.{i}."
    if spec.moe is None or not name.startswith("mlp.") or not spec.moe.sparse(i):
        return llama.layer_source(spec, i, name)  # attention, norms and dense MLP layers
    e = range(spec.moe.num_experts)
    fused = {"mlp.router.weight": Source([p + "mlp.gate.weight"]),
             "mlp.gate_up": Source([p + "mlp.experts.gate_up_proj"]),
             "mlp.down": Source([p + "mlp.experts.down_proj"])}
    if spec.family == "mixtral":
        x = p + "block_sparse_moe."
        per_expert = {"mlp.router.weight": Source([x + "gate.weight"]),
                      "mlp.gate_up": Source([x + f"experts.{j}.{w}.weight" for j in e for w in ("w1", "w3")],
                                            stack_pairs),
                      "mlp.down": Source([x + f"experts.{j}.w2.weight" for j in e], stack0)}
    else:
        x = p + "mlp.experts."
        per_expert = {"mlp.gate_up": Source([x + f"{j}.{w}_proj.weight" for j in e for w in ("gate", "up")],
                                            stack_pairs),
                      "mlp.down": Source([x + f"{j}.down_proj.weight" for j in e], stack0)}
    if name in per_expert:
        return replace(per_expert[name], fallback=fused[name])
    if name in fused:
        return fused[name]
    shared = {"mlp.shared.up.weight": Source([p + "mlp.shared_expert.gate_proj.weight",
                                              p + "mlp.shared_expert.up_proj.weight"], cat0),
              "mlp.shared.down.weight": Source([p + "mlp.shared_expert.down_proj.weight"]),
              "mlp.shared_gate.weight": Source([p + "mlp.shared_expert_gate.weight"])}
    return shared[name]

