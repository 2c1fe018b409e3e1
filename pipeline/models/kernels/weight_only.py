"""Weight-only integer projections of pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors
``pack-quantized``): :class:`IntWeight` (what a format's reader decodes) and :class:`QuantLinear`.

Every format is ``W[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)]``: unsigned codes (int4 two to a byte),
float32 scales and zero points (code units) per output row and group, ``g(i) = i // group_size`` or
GPTQ act-order's ``g_idx[i]``. Kernels (``dequantize``; torch's packed ``int4pack``, whose offsets are
``(8 - z) * s``, act-order columns stored sorted by group; ``int8pack``) round differently, so
:func:`choose_kernels` times them once per kind of machine and keeps the choice (docs/usage/quantization.md).
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.kernels.int8 import Float32Buffers, median_times
from pipeline.models.kernels.kernel_table import KernelTable, set_per_shape

log = logging.getLogger(__name__)

KERNELS = ("dequantize", "int4pack", "int8pack")


@dataclass
class IntWeight:
    """A decoded integer weight: codes (out, in) uint8, scales and zero points (out, groups) float32."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group_size: int  # input columns per group (the whole row for per-channel scales)
    g_idx: torch.Tensor | None = None  # (in,) group of each input column when not column // group_size

    def groups(self) -> torch.Tensor:
        """(in,) group of each input column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.codes.shape[1]) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.groups().to(self.codes.device)
        return ((self.codes.float() - self.zeros[:, g]) * self.scales[:, g]).to(dtype)


def cat_out(parts: list[IntWeight]) -> IntWeight:
    """Weights stacked along the output rows (q, k, v -> qkv): same bits, groups and act order needed."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size) != (first.bits, first.group_size) or p.codes.shape[1] != first.codes.shape[1]:
            raise ValueError(f"fused projections quantized differently ({p.bits} vs {first.bits} bits, groups of "
                             f"{p.group_size} vs {first.group_size})")
        if (p.g_idx is None) != (first.g_idx is None) or (p.g_idx is not None and not torch.equal(p.g_idx, first.g_idx)):
            raise ValueError("fused projections (e.g. q, k and v) have different act-order g_idx; this runner "
                             "fuses them and needs one column order")
    if len(parts) == 1:
        return first
    return IntWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                     torch.cat([p.zeros for p in parts]), first.bits, first.group_size, first.g_idx)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(out, in) uint8 codes 0..15 -> (out, in / 2) bytes, column 2k in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


class QuantLinear(Float32Buffers):
    """A projection with integer weights of ``bits`` bits in groups of ``group_size`` input columns.

    Built on the meta device with the shapes from the config, filled by :meth:`load`. Buffers:
    ``qweight`` (out, in * bits / 8) uint8, ``scales`` / ``zeros`` (out, groups) float32,
    ``perm`` (in,) long when act-order columns are stored sorted by group (else empty)."""

    float32_buffers = ("scales", "zeros")

    def __init__(self, in_features: int, out_features: int, bias: bool, bits: int, group_size: int):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"{bits}-bit weights: only 4 and 8 are supported")
        group_size = in_features if group_size <= 0 else group_size
        if in_features % group_size or in_features % 2:
            raise ValueError(f"{in_features} input columns are not a whole number of groups of {group_size}")
        self.in_features, self.out_features, self.bits, self.group_size = in_features, out_features, bits, group_size
        groups = in_features // group_size
        self.register_buffer("qweight", torch.empty(out_features, in_features * bits // 8, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=torch.float32))
        self.register_buffer("zeros", torch.empty(out_features, groups, dtype=torch.float32))
        self.register_buffer("perm", torch.empty(0, dtype=torch.long))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel = "dequantize"
        self.packed: torch.Tensor | None = None  # the int4pack / int8pack kernel's operand
        self.packed_sz: torch.Tensor | None = None  # int4pack: (groups, out, 2) scales and offsets

    @torch.no_grad()
    def load(self, w: IntWeight) -> None:
        """Fill from a decoded weight (shapes checked: a mismatch names both)."""
        want = (self.out_features, self.in_features)
        if tuple(w.codes.shape) != want or w.bits != self.bits or w.scales.shape != self.scales.shape:
            raise ValueError(f"quantized weight {tuple(w.codes.shape)} ({w.bits} bits, scales "
                             f"{tuple(w.scales.shape)}) does not fit {want} ({self.bits} bits, scales "
                             f"{tuple(self.scales.shape)})")
        codes, scales, zeros = w.codes, w.scales, w.zeros
        if w.g_idx is not None and not torch.equal(w.g_idx.long(), torch.arange(self.in_features) // self.group_size):
            counts = torch.bincount(w.g_idx.long(), minlength=self.scales.shape[1])
            if not bool((counts == self.group_size).all()):
                raise ValueError("act-order g_idx whose groups are not all of group_size columns")
            perm = torch.argsort(w.g_idx.long(), stable=True)  # columns sorted by group: groups contiguous
            codes, self.perm = codes[:, perm], perm.to(self.qweight.device)
        dev = self.qweight.device
        self.qweight.copy_(pack_int4(codes) if self.bits == 4 else codes)
        self.scales.copy_(scales.to(dev))
        self.zeros.copy_(zeros.to(dev))

    def codes(self) -> torch.Tensor:
        """(out, in) uint8 codes, columns in storage order."""
        return unpack_int4(self.qweight) if self.bits == 4 else self.qweight

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """(out, in) weight in ``dtype``, columns in storage order."""
        s = self.scales.repeat_interleave(self.group_size, 1)
        z = self.zeros.repeat_interleave(self.group_size, 1)
        return ((self.codes().float() - z) * s).to(dtype)

    def set_kernel(self, kernel: str) -> None:
        """Use ``kernel`` (its operands prepared now); raises RuntimeError where it cannot run."""
        if kernel == "int4pack":
            self.packed, self.packed_sz = prepare_int4pack(self)
        elif kernel == "int8pack":
            self.packed = prepare_int8pack(self)
        else:
            self.packed = self.packed_sz = None
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (m, in)
        if self.perm.numel():
            flat = flat.index_select(1, self.perm)  # the input's columns in the weight's stored order
        y = run_kernel(self, flat, self.kernel)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group={self.group_size}, "
                f"act_order={bool(self.perm.numel())}, kernel={self.kernel}")


def run_kernel(m: QuantLinear, x: torch.Tensor, kernel: str) -> torch.Tensor:
    """(rows, in) -> (rows, out) without bias, by ``kernel``."""
    if kernel == "int4pack":
        if x.is_cuda:
            return torch.ops.aten._weight_int4pack_mm(x, m.packed, m.group_size, m.packed_sz)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.packed, m.group_size, m.packed_sz.to(x.dtype))
    if kernel == "int8pack":
        return torch.ops.aten._weight_int8pack_mm(x, m.packed, m.scales[:, 0].to(x.dtype))
    return F.linear(x, m.dequantized(x.dtype))


def prepare_int4pack(m: QuantLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's tinygemm operands: packed codes and (groups, out, 2) [scale, (8 - zero) * scale]."""
    if m.bits != 4 or m.group_size not in (32, 64, 128, 256) or m.in_features % 64:
        raise RuntimeError(f"int4pack needs 4-bit groups of 32..256 columns (this layer: {m.bits} bits, "
                           f"groups of {m.group_size})")
    codes = m.codes().to(torch.int32)
    sz = torch.stack([m.scales, (8 - m.zeros) * m.scales], dim=-1).transpose(0, 1).contiguous()  # (groups, out, 2)
    if m.qweight.is_cuda:
        # the CUDA op takes two codes a byte, the even column in the high nibble (as torchao packs them)
        packed = torch.ops.aten._convert_weight_to_int4pack(((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8), 8)
        return packed, sz.to(torch.bfloat16)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2), sz


def prepare_int8pack(m: QuantLinear) -> torch.Tensor:
    """int8 values ``q - 128`` for ``_weight_int8pack_mm`` (symmetric per-channel 8-bit weights only)."""
    if m.bits != 8 or m.scales.shape[1] != 1 or not bool((m.zeros == 128).all()) or m.qweight.is_cuda:
        raise RuntimeError("int8pack needs symmetric 8-bit weights with one scale per row (CPU)")
    return (m.qweight.to(torch.int16) - 128).to(torch.int8).contiguous()


@torch.inference_mode()
def choose_kernels(model: nn.Module, dtype: torch.dtype, rows: tuple[int, ...] = (32, 256),
                   table: KernelTable | None = None) -> dict[str, dict]:
    """Choose the kernel of each distinct (in, out, bits, group, act order) shape of the stage's
    :class:`QuantLinear` layers (:func:`~pipeline.models.kernels.kernel_table.set_per_shape`); returns
    ``{"INxOUT": {"kernel": ..., "ms": {kernel: [median ms per size]}}}``. These kernels round
    differently (a float product of dequantized weights against torch's packed kernels), so a choice is
    an answer: with ``table`` it is measured once per kind of machine and then read by every run;
    without, measured now (the median of interleaved timings at ``rows`` token rows; the least total
    time wins)."""

    def shape(m: QuantLinear) -> tuple:
        return m.in_features, m.out_features, m.bits, m.group_size, bool(m.perm.numel())

    def plan(probe: QuantLinear) -> tuple[str, list[str], Callable[[], dict]]:
        k, n, bits, group, act_order = shape(probe)
        alive = [kernel for kernel in KERNELS if _runs(probe, kernel)]
        key = (f"weight-only/{probe.qweight.device.type}/{str(dtype).removeprefix('torch.')}/{k}x{n}/int{bits}/g{group}"
               f"{'/act-order' if act_order else ''}")
        return key, alive, functools.partial(_measure, probe, alive, dtype, rows)

    return set_per_shape([m for m in model.modules() if isinstance(m, QuantLinear)], shape, plan, table)


def _runs(probe: QuantLinear, kernel: str) -> bool:
    """Whether ``kernel`` can be set on ``probe`` here (its operands prepared; logged when not)."""
    try:
        probe.set_kernel(kernel)
        return True
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        log.debug("kernel %s unavailable for %dx%d int%d: %s", kernel, probe.in_features, probe.out_features,
                  probe.bits, str(e).splitlines()[0])
        return False


def _measure(probe: QuantLinear, alive: list[str], dtype: torch.dtype, rows: tuple[int, ...]) -> dict:
    """Median ms of each kernel of ``alive`` at each size of ``rows`` (interleaved): the least total wins."""
    gen = torch.Generator().manual_seed(0)
    ms: dict[str, list[float]] = {kernel: [] for kernel in alive}
    for m_rows in rows:
        x = torch.randn(m_rows, probe.in_features, generator=gen).to(device=probe.qweight.device, dtype=dtype)
        fns = {}
        for kernel in list(alive):
            try:
                probe.set_kernel(kernel)
                fns[kernel] = functools.partial(run_kernel, copy.copy(probe), x, kernel)
                fns[kernel]()
            except (RuntimeError, AttributeError, NotImplementedError) as e:
                log.debug("kernel %s fails at %d rows: %s", kernel, m_rows, str(e).splitlines()[0])
                alive.remove(kernel)
                ms.pop(kernel)
        for kernel, seconds in median_times(fns).items():
            ms[kernel].append(round(seconds * 1e3, 4))
    best = min(ms, key=lambda kernel: sum(ms[kernel]))
    return {"kernel": best, "rows": list(rows), "ms": ms}
