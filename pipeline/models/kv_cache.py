"""The KV cache of one micro-batch on one stage, preallocated: each row keeps its tokens at columns
``0..len-1`` (see :mod:`pipeline.models.decoder`)."""

from __future__ import annotations

import math
import mmap

import torch

from ..upload import to_device
from .spec import DecoderSpec


class KVCache:
    """Preallocated keys/values of one micro-batch on one stage: (layers, rows, kv_heads, cols, head_dim)."""

    def __init__(self, layers: int, rows: int, cols: int, spec: DecoderSpec, dtype, device):
        shape = (layers, rows, spec.num_kv_heads, cols, spec.head_dim)
        self.k = zeroed(shape, dtype, device)
        self.v = zeroed(shape, dtype, device)
        # longrope: which rows use the long factors (decided once, when the row's prompt is prefilled)
        self.long_rope = torch.zeros(rows, dtype=torch.bool, device=device)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def cols(self) -> int:
        return self.k.shape[3]

    def fork(self, src: int, dsts: list[int], ncols: int) -> None:
        """Copy row ``src``'s first ``ncols`` columns to ``dsts`` (best_of shares one prefill)."""
        idx = to_device(dsts, self.k.device, torch.long)
        self.k[:, idx, :, :ncols] = self.k[:, src : src + 1, :, :ncols]
        self.v[:, idx, :, :ncols] = self.v[:, src : src + 1, :, :ncols]
        self.long_rope[idx] = self.long_rope[src].clone()


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed cache tensor. On the CPU its memory is an anonymous mapping: the kernel's zero pages,
    each made resident when first written, so the columns a micro-batch never reaches cost nothing
    and allocating costs no pass over the whole tensor (``torch.zeros`` of a 64-row slot of the 86M
    benchmark model, 1.4 GB for the keys, took ~0.7 s on the 2-core VM; masked columns must hold finite
    values, so an uninitialized tensor would not do). The mapping is unmapped with the tensor."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, count * dtype.itemsize)  # private, anonymous: zero-filled on first touch
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)  # the tensor keeps buf alive
