"""The KV cache of one micro-batch on one stage, preallocated: each row keeps its tokens at columns
``0..len-1`` (see :mod:`pipeline.models.decoder`)."""

from __future__ import annotations

import torch

from ..upload import to_device
from .spec import DecoderSpec


class KVCache:
    """Preallocated keys/values of one micro-batch on one stage: (layers, rows, kv_heads, cols, head_dim)."""

    def __init__(self, layers: int, rows: int, cols: int, spec: DecoderSpec, dtype, device):
        shape = (layers, rows, spec.num_kv_heads, cols, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
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
