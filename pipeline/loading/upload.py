"""Checkpoint tensors into a stage's parameters, already in the run's dtype on the device.

On the CPU, safetensors tensors go straight into their parameters through
:mod:`pipeline.loading.parallel_read`; the rest (other layouts, combined tensors) are copied here,
casting when the stored dtype differs. On CUDA it is read into one of two pinned (page-locked) host buffers used in turn and
copied to the device asynchronously (``non_blocking=True`` from pinned memory is a DMA that does
not block the host): reading the next tensor from disk overlaps the previous copy, and a buffer is
reused only once the event recorded after its copy has completed.
"""

from __future__ import annotations

import torch


class Uploader:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._pinned: list[torch.Tensor | None] = [None, None]
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def target(self, param: torch.Tensor) -> torch.Tensor:
        """Where to read the stored tensor of ``param`` (its dtype and shape): the parameter itself on
        the CPU, the next pinned buffer on CUDA."""
        if not self.cuda:
            return param
        i, nbytes = self._turn, param.numel() * param.element_size()
        if self._done[i] is not None:
            self._done[i].synchronize()  # its previous copy has left the buffer
        if self._pinned[i] is None or self._pinned[i].numel() < nbytes:
            self._pinned[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._pinned[i][:nbytes].view(param.dtype).view(param.shape)

    def commit(self, param: torch.Tensor, target: torch.Tensor) -> None:
        """``target`` (from :meth:`target`) now holds the tensor: start its copy into ``param``."""
        if not self.cuda:
            return
        param.copy_(target, non_blocking=True)
        self._done[self._turn] = torch.cuda.Event()
        self._done[self._turn].record()
        self._turn ^= 1

    def put(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Copy a tensor of any dtype (a combined or differently stored one) into ``param``, casting."""
        if self.cuda and value.dtype == param.dtype and value.shape == param.shape:
            target = self.target(param)
            target.copy_(value)
            self.commit(param, target)
        else:
            param.copy_(value)

    def finish(self) -> None:
        """Wait for every copy (the pinned buffers are freed after)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._pinned, self._done = [None, None], [None, None]


