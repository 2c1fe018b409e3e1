"""The feed-forward block of a decoder layer: plain or gated (SwiGLU/GeGLU), with per-row LoRA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.kernels.invariant import fixed_elementwise, map_rows
from pipeline.models.lora import LoraRows
from pipeline.models.spec import DecoderSpec

MLP_ROWS = 1024  # tokens of one MLP call at most (default mode): large enough for the GEMMs' full speed

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
        if self.tile:
            return map_rows(self._mlp, x, self.tile)
        if lora is not None or x.numel() <= MLP_ROWS * x.shape[-1]:
            return self._mlp(x, lora, layer)
        # a long prefill pass: MLP_ROWS tokens at a time, so the (tokens, 2 x intermediate) activations
        # stay tens of MiB (8192 tokens of a 1B model's gate/up were 370 MB of float32 at once, kept
        # by a CPU stage's heap: a tenth of its int8 weights' resident size again)
        flat = x.reshape(-1, x.shape[-1])
        y = None
        for a in range(0, flat.shape[0], MLP_ROWS):
            part = self._mlp(flat[a : a + MLP_ROWS])
            if y is None:
                y = part.new_empty(flat.shape[0], part.shape[-1])
            y[a : a + part.shape[0]] = part
        return y.reshape(*x.shape[:-1], y.shape[-1])

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
