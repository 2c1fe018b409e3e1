"""Every rank of a pipeline in one process (``--in-process``): threads joined by in-memory links.

:class:`LocalWorld` stands for the process group (one FIFO per directed link, a group that agrees on a
value); :class:`LocalMessenger` has :class:`comm.p2p.Messenger`'s interface and carries the same framed
bytes, so the wire format is exercised as between processes (a CUDA payload goes as a tensor: stages
may then share a GPU). A rank that fails is marked dead (:meth:`LocalWorld.fail`): its neighbours'
receives raise :class:`comm.p2p.PeerLost`, as a closed gloo connection does.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from comm.p2p import PeerLost, frame, unframe

POLL_S = 0.05  # how often a waiting receive looks whether its peer died


class _Dead:
    """What a dead rank's links carry after its last message."""

    def __init__(self, why: str):
        self.why = why


class LocalGroup:
    """The ranks of one process agreeing on a value (every rank calls, as a collective)."""

    def __init__(self, size: int):
        self.size = size
        self._barrier = threading.Barrier(size)
        self._values: list[int] = []
        self._lock = threading.Lock()

    def agree_min(self, value: int) -> int:
        """The least ``value`` over every rank (raises PeerLost when a rank died before calling)."""
        with self._lock:
            self._values.append(value)
        try:
            self._barrier.wait()
            least = min(self._values)
            if self._barrier.wait() == 0:  # every rank read it: the next call starts afresh
                self._values.clear()
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise PeerLost(-1, RuntimeError("a rank of this process failed")) from None
        return least

    def abort(self) -> None:
        self._barrier.abort()


class LocalWorld:
    """The in-memory links and group of ``size`` ranks in this process."""

    def __init__(self, size: int):
        self.size = size
        self.links: dict[tuple[int, int], queue.SimpleQueue] = {}
        self.group = LocalGroup(size)
        self.dead: dict[int, str] = {}
        self._lock = threading.Lock()

    def link(self, src: int, dst: int) -> queue.SimpleQueue:
        with self._lock:
            return self.links.setdefault((src, dst), queue.SimpleQueue())

    def fail(self, rank: int, why: str) -> None:
        """Rank ``rank`` stopped on an error: whoever waits for it hears so."""
        with self._lock:
            self.dead.setdefault(rank, why)
            links = [q for (src, _), q in self.links.items() if src == rank]
        for q in links:
            q.put(_Dead(why))
        self.group.abort()


class LocalMessenger:
    """:class:`comm.p2p.Messenger` over a :class:`LocalWorld` (see the module docstring)."""

    def __init__(self, rank: int, device: torch.device, world: LocalWorld, trace=None):
        self.rank, self.device, self.world, self.trace = rank, device, world, trace

    def send(self, dst: int, header: bytes, tensor: torch.Tensor | None = None) -> None:
        if dst in self.world.dead:
            raise PeerLost(dst, RuntimeError(f"rank {dst} stopped: {self.world.dead[dst]}"))
        inline = tensor is None or tensor.device.type == "cpu"
        msg = frame(header, tensor, inline)
        self.world.link(self.rank, dst).put((msg, None if inline else tensor.clone()))

    def send_now(self, dst: int, header: bytes) -> None:
        self.send(dst, header)

    def expect(self, src: int) -> None:
        """Nothing to post: a message is in the link's queue as soon as it is sent."""

    def recv(self, src: int) -> tuple[bytes, torch.Tensor | None]:
        t0 = time.perf_counter()
        link = self.world.link(src, self.rank)
        while True:
            try:
                item = link.get(timeout=POLL_S)
                break
            except queue.Empty:
                if src in self.world.dead and link.empty():
                    item = _Dead(self.world.dead[src])
                    break
        if isinstance(item, _Dead):
            raise PeerLost(src, RuntimeError(f"rank {src} stopped: {item.why}"))
        msg, tensor = item
        header, inline = unframe(msg)
        if tensor is not None:
            tensor = tensor.to(self.device)
        if self.trace is not None:
            self.trace.add("recv", t0, time.perf_counter(), tid=1, args={"from": src})
        return header, inline if tensor is None else tensor

    def flush(self) -> None:
        """Nothing in flight: a sent message is already in its link's queue."""
