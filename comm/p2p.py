"""Point-to-point messages between pipeline ranks: a small encoded header plus an optional tensor.

Each message is three transfers: a fixed int64 "meta" tensor (header length, payload bytes, dtype,
shape), the header as bytes, and the payload as bytes. Sends are asynchronous (``isend``) and their
buffers are kept until they complete, so no two ranks can block sending to each other; receives
block. Messages between a pair of ranks arrive in the order they were sent.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
_META = 8  # [header_len, payload_bytes, dtype_code, ndim, d0, d1, d2, 0]
_WINDOW = 48  # sends kept without waiting for them (see Messenger._reap)


class PeerLost(RuntimeError):
    """A pipeline neighbour died or stopped answering."""

    def __init__(self, rank: int, cause: Exception):
        super().__init__(f"lost contact with rank {rank} ({str(cause).splitlines()[0][:200]}); "
                         f"see rank {rank}'s log for its error")
        self.rank = rank


class Messenger:
    """Header + tensor messages over an initialized process group (gloo or NCCL)."""

    def __init__(self, device: torch.device, trace=None):
        # NCCL moves only device tensors; gloo only CPU tensors.
        self.device, self.trace = device, trace
        self._pending: list[tuple[dist.Work, tuple[torch.Tensor, ...]]] = []

    def send(self, dst: int, header: bytes, tensor: torch.Tensor | None = None) -> None:
        self._reap()
        hdr = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device)
        meta = torch.zeros(_META, dtype=torch.int64)
        meta[0] = hdr.numel()
        parts: list[torch.Tensor] = [hdr]
        if tensor is not None:
            assert tensor.dim() <= 3, "payloads are at most 3-d"
            payload = tensor.contiguous().view(-1).view(torch.uint8).to(self.device)
            meta[1] = payload.numel()
            meta[2] = _DTYPES.index(tensor.dtype)
            meta[3] = tensor.dim()
            meta[4 : 4 + tensor.dim()] = torch.tensor(tensor.shape)
            parts.append(payload)
        meta = meta.to(self.device)
        try:
            for t in (meta, *parts):
                self._pending.append((dist.isend(t, dst), (t,)))
        except RuntimeError as e:
            raise PeerLost(dst, e) from None

    def recv(self, src: int) -> tuple[bytes, torch.Tensor | None]:
        t0 = time.perf_counter()
        try:
            meta = torch.empty(_META, dtype=torch.int64, device=self.device)
            dist.recv(meta, src)
            meta = meta.tolist()
            hdr = torch.empty(meta[0], dtype=torch.uint8, device=self.device)
            dist.recv(hdr, src)
            header = hdr.cpu().numpy().tobytes()
            tensor = None
            if meta[1]:
                payload = torch.empty(meta[1], dtype=torch.uint8, device=self.device)
                dist.recv(payload, src)
                shape = meta[4 : 4 + meta[3]]
                tensor = payload.view(_DTYPES[meta[2]]).view(shape)
        except RuntimeError as e:  # gloo/NCCL: the peer's connection closed, or the timeout passed
            raise PeerLost(src, e) from None
        if self.trace is not None:
            self.trace.add("recv", t0, time.perf_counter(), tid=1, args={"from": src})
        return header, tensor

    def _reap(self) -> None:
        """Forget finished sends. A gloo send reports completion only through ``wait()``, so beyond
        the last ``_WINDOW`` sends the oldest are waited for: the peer receives in order and took them
        long ago, so this does not block, and a long run (a server) keeps neither their buffers nor
        an ever longer list to scan on every send."""
        self._pending = [(w, keep) for w, keep in self._pending if not w.is_completed()]
        if len(self._pending) > _WINDOW:
            old, self._pending = self._pending[:-_WINDOW], self._pending[-_WINDOW:]
            try:
                for work, _ in old:
                    work.wait()
            except RuntimeError as e:
                raise PeerLost(-1, e) from None

    def flush(self) -> None:
        """Wait until every message sent so far has left this process."""
        try:
            for work, _ in self._pending:
                work.wait()
        except RuntimeError as e:
            raise PeerLost(-1, e) from None
        self._pending.clear()
