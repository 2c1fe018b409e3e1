"""The feed-forward block of a decoder layer: plain or gated (SwiGLU/GeGLU), with per-row LoRA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.kernels.invariant import fixed_elementwise, map_rows
from pipeline.models.lora import LoraRows
from pipeline.models.spec import DecoderSpec

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec, tile: int = 0):
        super().__init__()
        self.gated, self.tile = spec.mlp == "gated", tile
        width = 2 * spec.intermediate_size if self.gated else spec.intermediate_size
        self.up = nn.Linear(spec.hidden_size, width, bias=spec.mlp_bias)  # gated: [gate; up]
        self.down = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.act = ACTIVATIONS[spec.activation]

    def forward(self, x: torch.Tensor, lora: LoraRows | None = None, layer: int = 0) -> torch.Tensor:
        return map_rows(self._mlp, x, self.tile) if self.tile else self._mlp(x, lora, layer)

    def _mlp(self, x: torch.Tensor, lora: LoraRows | None = None, layer: int = 0) -> torch.Tensor:
        h = self.up(x)
        if getattr(self.down, "prologue", None) == "silu_gate":  # int8 down: act(gate) * up as it quantizes
            return self.down(h)
        if lora is not None:  # never with tiles: --batch-invariant refuses adapters
            h = lora.add(layer, "mlp.up", x, h)
        act = (lambda a: fixed_elementwise(self.act, a)) if self.tile else self.act  # tile: x is (rows, w)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            a = act(gate.contiguous() if self.tile else gate) * up
        else:
            a = act(h)
        y = self.down(a)
        return y if lora is None else lora.add(layer, "mlp.down", a, y)
