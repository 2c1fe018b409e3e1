"""Positions: rotary frequencies (with their scaling variants), the rotary tables of a stage, and
ALiBi slopes. Used by :mod:`pipeline.models.decoder`."""

from __future__ import annotations

import math

import torch

from pipeline.models.kernels.invariant import RopeTable
from pipeline.models.spec import RopeSpec


def rope_inv_freq(rope: RopeSpec, long: bool = False) -> torch.Tensor:
    """inv_freq for the rotary dims, with linear, llama3 or longrope scaling as HF computes it (float32).
    ``long``: longrope's table for rows longer than ``original_max_position``."""
    rd = rope.rotary_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    if rope.scaling_type == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float64)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"longrope needs {inv_freq.numel()} {'long' if long else 'short'} factors "
                             f"(rotary dims / 2), the config has {factors.numel()}")
        inv_freq = inv_freq / factors
    elif rope.scaling_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.scaling_type == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope.scaling_type != "default":
        raise ValueError(f"unsupported rope scaling {rope.scaling_type!r}")
    return inv_freq.float()


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes (BLOOM's construction, including non-power-of-two head counts)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Rotate the first rotary_dim dims of x (b, h, t, d); cos/sin are (b, 1, t, rotary_dim/2)."""
    rd = rope.rotary_dim
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    if rope.interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2 :]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated


class Rotary:
    """Rotary tables of one :class:`RopeSpec`; longrope keeps a second table for long rows."""

    def __init__(self, rope: RopeSpec, device: torch.device):
        self.rope = rope
        self.short = RopeTable(rope_inv_freq(rope).to(device), rope.attention_factor)
        self.long = None
        if rope.scaling_type == "longrope":
            self.long = RopeTable(rope_inv_freq(rope, long=True).to(device), rope.attention_factor)

    def lookup(self, pos: torch.Tensor, limit: int, dtype: torch.dtype,
               long_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.short.lookup(pos, limit, dtype)
        if self.long is not None and long_rows is not None:
            lcos, lsin = self.long.lookup(pos, limit, dtype)
            pick = long_rows[:, None, None, None]
            cos, sin = torch.where(pick, lcos, cos), torch.where(pick, lsin, sin)
        return cos, sin
