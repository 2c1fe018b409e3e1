"""What every pre-quantized format reader shares: the :class:`QuantFormat` interface, the error
for what is not understood, and int32 unpacking."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from pipeline.loading.tensor_store import CheckpointError
from pipeline.models.kernels.weight_only import IntWeight, QuantLinear, cat_out

Getter = Callable[..., torch.Tensor | None]  # get(name, optional=False) -> the stage's tensor


class UnsupportedQuantization(CheckpointError):
    """A quantization_config (or a variant in it) this runner cannot load exactly."""


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding ``32 / bits`` codes each (code k in bits ``k * bits ..``), unpacked along
    ``dim`` (the codes of one word become consecutive entries of ``dim``): int32 codes 0 .. 2^bits - 1."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)  # (32 / bits,)
    p = packed.to(torch.int32)
    if dim == 0:  # (rows, cols) -> (rows * 32 / bits, cols)
        return ((p.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)).reshape(-1, p.shape[1])
    return ((p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(p.shape[0], -1)


class QuantFormat:
    """One checkpoint format: ``name`` (the results' ``model`` suffix), which tensors a quantized
    linear has, how to build its module and how to decode its tensors."""

    name: str
    bits: int
    group_size: int

    def packed_names(self, base: str) -> list[str]:
        """The tensors every quantized linear ``base`` (an HF module name) has (GPTQ's and AWQ's names)."""
        return [f"{base}.qweight", f"{base}.qzeros", f"{base}.scales"]

    def module(self, base: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return QuantLinear(in_features, out_features, bias, self.bits, self.group_size)

    def read(self, get: Getter, base: str, in_features: int, out_features: int) -> IntWeight:
        raise NotImplementedError

    def fill(self, module: nn.Module, get: Getter, bases: list[str], rows: list[int]) -> None:
        """Decode ``bases`` (fused along the output rows, ``rows`` each) into ``module``."""
        module.load(cat_out([self.read(get, b, module.in_features, n) for b, n in zip(bases, rows)]))


def module_bytes(m: nn.Module) -> int:
    """Bytes a quantized projection holds (buffers and bias)."""
    return sum(t.numel() * t.element_size() for t in [*m.buffers(), *m.parameters()])

