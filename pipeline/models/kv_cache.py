"""The KV cache of one micro-batch on one stage, preallocated: each row keeps its tokens at columns
``0..len-1`` (see :mod:`pipeline.models.decoder`)."""

from __future__ import annotations

import mmap

import torch

from ..upload import to_device
from .spec import DecoderSpec


def zeroed(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.zeros(shape)``; on the CPU, large tensors in fresh anonymous memory instead, which the
    kernel hands out already zero and maps page by page as it is first written.

    A micro-batch's cache is sized for its longest possible rows, and most rows end well short of
    that: ``torch.zeros`` touched every page up front (on the benchmark's VM, first-touch runs at
    0.35-3.3 GB/s: a 2.8 GB float32 cache took 4.0 s of a 44 s generation file), where fresh memory
    costs only the pages rows write or attention reads (columns past every run's longest row are never
    touched). The memory goes back to the system when the tensor is freed. GPUs keep ``torch.zeros`` (a memset at
    device bandwidth)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < 1 << 20:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the mapping


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
