"""Whether a plan fits the memory it will run in, decided before anything is loaded (issue #46).

Each stage needs its weights, embedding or head, KV cache and adapters (:mod:`pipeline.config.sizing`,
on the meta device) plus :data:`PROCESS_BYTES` and :data:`SLACK`; a GPU stage is compared with its own
device's free memory, the CPU stages of one node with the node's available RAM together. A plan that
cannot fit is refused with the numbers and the changes that would make it fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.config.partition import gib

PROCESS_BYTES = 768 << 20  # torch, Python, tokenizer and buffers of one stage process on the CPU
SLACK = 0.10  # the allocator's slack and the passes' activations, as a share of weights + KV cache


@dataclass(frozen=True)
class StageNeed:
    """What one stage holds: ``weights`` (layers, embedding/head, adapters) and ``kv`` (its cache)."""

    stage: int
    weights: int
    kv: int

    @property
    def total(self) -> int:
        return int((self.weights + self.kv) * (1 + SLACK)) + PROCESS_BYTES


def stage_needs(layer_weights: list[int], layer_kv: list[int], first: int, last: int,
                ranges: list[tuple[int, int]], shared: int = 0) -> list[StageNeed]:
    """Per stage, from per-layer weight and KV bytes and the embedding (first) / head (last) bytes.
    ``shared``: bytes of a tied head's table, which a stage holding both ends has once
    (pipeline.models.decoder.StageModel.tie)."""
    out = []
    for s, (a, b) in enumerate(ranges):
        weights = sum(layer_weights[a:b]) + (first if s == 0 else 0) + (last if s == len(ranges) - 1 else 0)
        if s == 0 and s == len(ranges) - 1:
            weights -= shared
        out.append(StageNeed(s, weights, sum(layer_kv[a:b])))
    return out


def local_stages(rank: int, local_world: int, pipeline: int) -> list[int]:
    """Stages held by the processes of this rank's node (ranks are laid out node by node)."""
    first = rank - rank % max(1, local_world)
    return [r % pipeline for r in range(first, first + max(1, local_world))]


def fit_problem(needs: list[StageNeed], stages_here: list[int], available: int, device: torch.device,
                device_free: list[int] | None = None) -> str | None:
    """None when the stages fit; otherwise the numbers: each stage's need against what it has."""
    if device.type == "cuda" and device_free:
        short = [(n, device_free[n.stage % len(device_free)]) for n in needs if n.stage in stages_here
                 and n.total > device_free[n.stage % len(device_free)]]
        if not short:
            return None
        return "; ".join(f"stage {n.stage} needs {gib(n.total)} ({gib(n.weights)} weights, {gib(n.kv)} KV cache) "
                         f"but its GPU has {gib(free)} free" for n, free in short)
    need = sum(needs[s].total for s in stages_here)
    if need <= available:
        return None
    parts = ", ".join(f"stage {s}: {gib(needs[s].total)} ({gib(needs[s].weights)} weights, {gib(needs[s].kv)} "
                      f"KV cache)" for s in sorted(set(stages_here)))
    return (f"the {len(stages_here)} process(es) on this node need {gib(need)} ({parts}, each with "
            f"{gib(PROCESS_BYTES)} for the process and {SLACK:.0%} slack) but the node has {gib(available)} "
            f"available: {gib(need - available)} short")


def suggestions(weights_total: int, kv_total: int, dtype: torch.dtype, available: int, local_world: int) -> list[str]:
    """Changes that would fit: stages on more nodes, a 2-byte dtype, a smaller KV budget."""
    out = []
    per_node = available - local_world * PROCESS_BYTES
    if per_node > 0:
        nodes = -(-int((weights_total + kv_total) * (1 + SLACK)) // per_node)
        if nodes > 1:
            out.append(f"spread the stages over at least {nodes} nodes of this size (torchrun --nnodes {nodes}, "
                       "docs/usage/scale.md) or give each stage a device of its own")
    if dtype == torch.float32:
        out.append("--dtype bfloat16 (halves the weights)")
    if kv_total > 0.2 * (weights_total + kv_total):
        out.append("a smaller --budget (the KV cache is "
                   f"{gib(kv_total)} of it)")
    out.append("--quantize int8 (about half of bf16 weights), or --stage-memory to size stages yourself")
    return out
