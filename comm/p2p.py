"""Point-to-point messages between pipeline ranks: a small encoded header plus an optional tensor.

Every directed link ``src -> dst`` is a :class:`Channel` of its own, one way only: the message (sizes,
header and, over gloo, the payload's bytes) in one gloo transfer; under NCCL the payload on a second group
of that link alone. Sends are asynchronous; the receiver keeps a receive posted for the link's next
message (:meth:`Messenger.expect`). Why: docs/design/gpu-notes.md. Messages on a link arrive in order.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
_META = 8  # int64 [header_len, payload_numel, dtype_code, ndim, d0, d1, d2, message bytes]
_META_BYTES = _META * 8
_FIRST = 1 << 20  # bytes a posted receive takes: a decode pass's activations fit (32 rows x 4096 x 4 = 512 KiB)
_WINDOW = 48  # sends kept without waiting for them (see Messenger._reap)


def _payload_at(header_len: int) -> int:
    """Where an inline payload starts in a message: after the header, 64-byte aligned (any dtype's view)."""
    return -(-(_META_BYTES + header_len) // 64) * 64


def frame(header: bytes, tensor: torch.Tensor | None = None, inline: bool = True) -> torch.Tensor:
    """One message as bytes: the block of sizes, the encoded header and, ``inline``, the payload's bytes
    (copied to the host from a GPU tensor; otherwise only its dtype and shape are described, and it
    travels on its own)."""
    meta = torch.zeros(_META, dtype=torch.int64)
    meta[0] = len(header)
    if tensor is not None:
        assert tensor.dim() <= 3, "payloads are at most 3-d"
        meta[1], meta[2], meta[3] = tensor.numel(), _DTYPES.index(tensor.dtype), tensor.dim()
        meta[4 : 4 + tensor.dim()] = torch.tensor(tensor.shape)
    body = _payload_at(len(header))
    size = body + (tensor.numel() * tensor.element_size() if tensor is not None and inline else 0)
    meta[7] = size
    msg = torch.empty(size, dtype=torch.uint8)
    msg[:_META_BYTES] = meta.view(torch.uint8)
    if header:
        msg[_META_BYTES : _META_BYTES + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    if tensor is not None and inline:
        msg[body:] = tensor.reshape(-1).view(torch.uint8)
    return msg


def unframe(buf: torch.Tensor, inline: bool = True) -> tuple[bytes, torch.Tensor | None]:
    """Inverse of :func:`frame`: (header, payload) of a whole message; the payload is a view of ``buf``
    when ``inline``, else None (it travels on its own)."""
    meta = buf[:_META_BYTES].view(torch.int64).tolist()
    header = buf[_META_BYTES : _META_BYTES + meta[0]].numpy().tobytes()
    if not (meta[1] and inline):
        return header, None
    dtype, shape = _DTYPES[meta[2]], meta[4 : 4 + meta[3]]
    body = _payload_at(meta[0])
    return header, buf[body : body + meta[1] * dtype.itemsize].view(dtype).view(shape)


class PeerLost(RuntimeError):
    """A pipeline neighbour died or stopped answering."""

    def __init__(self, rank: int, cause: Exception, channel: str = "header"):
        super().__init__(f"lost contact with rank {rank} on the {channel} channel "
                         f"({str(cause).splitlines()[0][:200]}); see rank {rank}'s log for its error")
        self.rank = rank


@dataclass(frozen=True)
class Channel:
    """The directed link ``src -> dst``: its header group (gloo) and its payload group (None on the
    ring back to rank 0, which carries headers only, and over gloo, where payloads travel inline)."""

    src: int
    dst: int
    header: dist.ProcessGroup
    payload: dist.ProcessGroup | None
    inline: bool = True  # a payload may follow the header in the message (gloo); False: NCCL's ring back


def open_channels(rank: int, pipeline_size: int, data_size: int, backend: str,
                  timeout: datetime.timedelta) -> tuple[Channel, ...]:
    """Create every pipeline's directed links (a collective: every rank calls it, in the same order)
    and return this rank's. Links: stage s -> s+1 (and under NCCL a payload group) and the last
    stage -> stage 0 (the ring back: messages without payloads)."""
    mine = []
    if pipeline_size == 1:
        return ()
    for d in range(data_size):
        for s in range(pipeline_size):
            src, dst = d * pipeline_size + s, d * pipeline_size + (s + 1) % pipeline_size
            header = dist.new_group([src, dst], timeout=timeout, backend="gloo", group_desc=f"header {src}->{dst}")
            payload = None
            if s < pipeline_size - 1 and backend != "gloo":
                payload = dist.new_group([src, dst], timeout=timeout, backend=backend,
                                         group_desc=f"payload {src}->{dst}")
            if rank in (src, dst):
                mine.append(Channel(src, dst, header, payload, inline=backend == "gloo"))
    return tuple(mine)


class Messenger:
    """Header + tensor messages over this rank's channels (see the module docstring)."""

    def __init__(self, rank: int, device: torch.device, channels: tuple[Channel, ...], trace=None):
        self.device, self.trace = device, trace
        self.out = {c.dst: c for c in channels if c.src == rank}
        self.inp = {c.src: c for c in channels if c.dst == rank}
        self._buffers: dict[int, torch.Tensor] = {}  # src -> reusable GPU payload buffer (bytes)
        self._pending: list[tuple[dist.Work, tuple[torch.Tensor, ...]]] = []
        # src -> the receive posted for its next message (work, buffer); two buffers per link in turn,
        # so the next message lands beside the one the stage is still reading
        self._posted: dict[int, tuple[dist.Work, torch.Tensor]] = {}
        self._inbox = {src: [torch.empty(_FIRST, dtype=torch.uint8) for _ in range(2)] for src in self.inp}

    def send(self, dst: int, header: bytes, tensor: torch.Tensor | None = None) -> None:
        self._reap()
        ch = self.out[dst]
        if tensor is not None:
            tensor = tensor.to(self.device).contiguous()
        inline = tensor is not None and ch.payload is None  # gloo: the payload's bytes follow the header
        assert not inline or ch.inline, f"the link {ch.src} -> {ch.dst} carries headers only"
        msg = frame(header, tensor, inline)
        try:
            for part in (msg[:_FIRST], msg[_FIRST:]) if msg.numel() > _FIRST else (msg,):
                self._pending.append((dist.isend(part, dst, group=ch.header), (msg,)))
        except RuntimeError as e:
            raise PeerLost(dst, e) from None
        if tensor is not None and not inline:
            try:
                self._pending.append((dist.isend(tensor, dst, group=ch.payload), (tensor,)))
            except RuntimeError as e:
                raise PeerLost(dst, e, "payload") from None

    def send_now(self, dst: int, header: bytes) -> None:
        """:meth:`send` a header and wait until it has left this process: a message that must reach the
        peer even if this process dies right after (pipeline.runtime.messages.Admitting)."""
        n = len(self._pending)
        self.send(dst, header)
        try:
            for work, _ in self._pending[n:]:
                work.wait()
        except RuntimeError as e:
            raise PeerLost(dst, e) from None

    def expect(self, src: int) -> None:
        """Post the receive for ``src``'s next message now (see the module docstring). Not after the
        last message (stop): a receive nobody answers would be left at shutdown."""
        if src in self._posted:
            return
        spare = self._inbox[src]
        spare.reverse()  # the buffer the last message did not use
        try:
            self._posted[src] = (dist.irecv(spare[0], src, group=self.inp[src].header), spare[0])
        except RuntimeError as e:
            raise PeerLost(src, e) from None

    def recv(self, src: int) -> tuple[bytes, torch.Tensor | None]:
        """The next message from ``src``: (header, payload or None). The payload is valid until the
        next receive from ``src``."""
        t0 = time.perf_counter()
        ch = self.inp[src]
        self.expect(src)
        work, buf = self._posted.pop(src)
        try:  # gloo: a closed connection (the peer died) raises at once
            work.wait()
            meta = buf[:_META_BYTES].view(torch.int64).tolist()
            if meta[7] > _FIRST:  # the rest follows as a second transfer
                big = torch.empty(meta[7], dtype=torch.uint8)
                big[:_FIRST] = buf
                dist.recv(big[_FIRST:], src, group=ch.header)
                buf = big
        except RuntimeError as e:
            raise PeerLost(src, e) from None
        header, tensor = unframe(buf, inline=ch.payload is None)
        if tensor is None and meta[1]:  # NCCL: the payload follows on its own group
            dtype, shape = _DTYPES[meta[2]], meta[4 : 4 + meta[3]]
            nbytes = meta[1] * dtype.itemsize
            # the link's reusable GPU buffer: valid until the next receive from ``src`` (the stage consumes
            # it in between; under NCCL that receive is queued behind the compute already on the stream)
            buf = self._buffers.get(src)
            if buf is None or buf.numel() < nbytes:
                buf = self._buffers[src] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            tensor = buf[:nbytes].view(dtype).view(shape)
            try:  # returns once the receive is queued; the current stream waits for it
                dist.recv(tensor, src, group=ch.payload)
            except RuntimeError as e:
                raise PeerLost(src, e, "payload") from None
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
        """Wait until every message sent so far has left this process (on CUDA: the device too)."""
        try:
            for work, _ in self._pending:
                work.wait()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # NCCL's wait() only orders streams; the host waits here
        except RuntimeError as e:
            raise PeerLost(-1, e) from None
        self._pending.clear()
