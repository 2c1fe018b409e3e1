"""Host data onto a stage's device without waiting for it."""

from __future__ import annotations

import torch


def to_device(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host data (a list or a CPU tensor) on ``device`` without blocking the host: on CUDA through a
    pinned buffer and a ``non_blocking`` copy (PyTorch's pinned-memory allocator keeps the buffer
    until the copy is done); on the CPU the tensor itself."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if device.type != "cuda" or t.is_cuda:  # the CPU, or already on the GPU (a received payload)
        return t
    return t.pin_memory().to(device, non_blocking=True)
