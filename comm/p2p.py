"""Point-to-point messages between pipeline ranks: a small encoded header plus an optional tensor.

Every directed link ``src -> dst`` is a :class:`Channel` of its own, carrying traffic one way only:

- the **header** (the encoded message, and the payload's dtype and shape) goes over a CPU group
  (gloo) created for this link alone, so a header never touches the GPU and a closed socket is
  seen at once;
- the **payload** tensor goes over a second group of this link alone (NCCL on GPU, gloo on CPU).
  NCCL creates one communicator per group for a pair of ranks, so no NCCL pair ever carries
  traffic both ways (rank 0 -> 1 and the ring back 1 -> 0 at P = 2 are different groups).

Sends are asynchronous (``isend``) and their buffers kept until they complete, so no two ranks
block sending to each other; receives block the host on the header, then receive the payload into
a per-link buffer that is reused (grown when needed). Messages on a link arrive in the order they
were sent: the header of message k, then its payload, on two FIFO groups read in that order.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
_META = 8  # [header_len, payload_numel, dtype_code, ndim, d0, d1, d2, 0]
_WINDOW = 48  # sends kept without waiting for them (see Messenger._reap)


class PeerLost(RuntimeError):
    """A pipeline neighbour died or stopped answering."""

    def __init__(self, rank: int, cause: Exception, channel: str = "header"):
        super().__init__(f"lost contact with rank {rank} on the {channel} channel "
                         f"({str(cause).splitlines()[0][:200]}); see rank {rank}'s log for its error")
        self.rank = rank


@dataclass(frozen=True)
class Channel:
    """The directed link ``src -> dst``: its header group (gloo) and its payload group (None on the
    ring back to rank 0, which carries headers only)."""

    src: int
    dst: int
    header: dist.ProcessGroup
    payload: dist.ProcessGroup | None


def open_channels(rank: int, pipeline_size: int, data_size: int, backend: str,
                  timeout: datetime.timedelta) -> tuple[Channel, ...]:
    """Create every pipeline's directed links (a collective: every rank calls it, in the same order)
    and return this rank's. Links: stage s -> s+1 (headers + payloads) and the last stage -> stage 0
    (the ring back: headers only)."""
    mine = []
    if pipeline_size == 1:
        return ()
    for d in range(data_size):
        for s in range(pipeline_size):
            src, dst = d * pipeline_size + s, d * pipeline_size + (s + 1) % pipeline_size
            header = dist.new_group([src, dst], timeout=timeout, backend="gloo", group_desc=f"header {src}->{dst}")
            payload = None
            if s < pipeline_size - 1:
                payload = dist.new_group([src, dst], timeout=timeout, backend=backend,
                                         group_desc=f"payload {src}->{dst}")
            if rank in (src, dst):
                mine.append(Channel(src, dst, header, payload))
    return tuple(mine)


class Messenger:
    """Header + tensor messages over this rank's channels (see the module docstring)."""

    def __init__(self, rank: int, device: torch.device, channels: tuple[Channel, ...], trace=None):
        self.device, self.trace = device, trace
        self.out = {c.dst: c for c in channels if c.src == rank}
        self.inp = {c.src: c for c in channels if c.dst == rank}
        self._buffers: dict[int, torch.Tensor] = {}  # src -> reusable payload buffer (bytes)
        self._pending: list[tuple[dist.Work, tuple[torch.Tensor, ...]]] = []

    def send(self, dst: int, header: bytes, tensor: torch.Tensor | None = None) -> None:
        self._reap()
        ch = self.out[dst]
        hdr = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        meta = torch.zeros(_META, dtype=torch.int64)
        meta[0] = hdr.numel()
        if tensor is not None:
            assert ch.payload is not None, f"the link {ch.src} -> {ch.dst} carries headers only"
            assert tensor.dim() <= 3, "payloads are at most 3-d"
            tensor = tensor.to(self.device).contiguous()
            meta[1], meta[2], meta[3] = tensor.numel(), _DTYPES.index(tensor.dtype), tensor.dim()
            meta[4 : 4 + tensor.dim()] = torch.tensor(tensor.shape)
        try:
            for t in (meta, hdr):
                self._pending.append((dist.isend(t, dst, group=ch.header), (t,)))
        except RuntimeError as e:
            raise PeerLost(dst, e) from None
        if tensor is not None:
            try:
                self._pending.append((dist.isend(tensor, dst, group=ch.payload), (tensor,)))
            except RuntimeError as e:
                raise PeerLost(dst, e, "payload") from None

    def recv(self, src: int) -> tuple[bytes, torch.Tensor | None]:
        t0 = time.perf_counter()
        ch = self.inp[src]
        try:  # gloo: a closed connection (the peer died) raises at once
            meta = torch.empty(_META, dtype=torch.int64)
            dist.recv(meta, src, group=ch.header)
            meta = meta.tolist()
            hdr = torch.empty(meta[0], dtype=torch.uint8)
            dist.recv(hdr, src, group=ch.header)
        except RuntimeError as e:
            raise PeerLost(src, e) from None
        tensor = None
        if meta[1]:
            dtype, shape = _DTYPES[meta[2]], meta[4 : 4 + meta[3]]
            tensor = self._buffer(src, meta[1] * dtype.itemsize)[: meta[1] * dtype.itemsize].view(dtype).view(shape)
            try:  # NCCL: returns once the receive is queued; the current stream waits for it
                dist.recv(tensor, src, group=ch.payload)
            except RuntimeError as e:
                raise PeerLost(src, e, "payload") from None
        if self.trace is not None:
            self.trace.add("recv", t0, time.perf_counter(), tid=1, args={"from": src})
        return hdr.numpy().tobytes(), tensor

    def _buffer(self, src: int, nbytes: int) -> torch.Tensor:
        """The reusable receive buffer of link ``src ->``, at least ``nbytes`` long. A received
        tensor is valid until the next receive from ``src`` (the stage consumes it in between; under
        NCCL the next receive is queued behind the compute already queued on the current stream)."""
        buf = self._buffers.get(src)
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[src] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf

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
        """Wait until every message sent so far has left this process (on CUDA: the device too)."""
        try:
            for work, _ in self._pending:
                work.wait()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # NCCL's wait() only orders streams; the host waits here
        except RuntimeError as e:
            raise PeerLost(-1, e) from None
        self._pending.clear()
