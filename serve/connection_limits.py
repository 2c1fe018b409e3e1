"""Connection limits under uvicorn's h11 protocol, as nginx's ``client_header_timeout``,
``client_body_timeout`` and ``send_timeout`` (docs/usage/serve.md, "Limits", says what each does).

uvicorn bounds keep-alive idleness and requests in progress (``limit_concurrency``, checked only once a
request head is complete), but a connection that sends half a head and waits holds its socket forever:
enough of them use up the open-file limit and no client gets in, not even to ``/health``.
:class:`GuardedH11` (uvicorn's ``H11Protocol`` with a few hooks) caps open connections (closing the one
waiting longest for a head first, so idle sockets cannot keep a live client out) and times out a request
head, a stalled body (408) and output the client leaves unread. One sweep a second (a quarter of the
shortest timeout when that is shorter) checks every connection's clocks: no timer per read.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("serve")

FD_RESERVE = 64  # open files kept for everything but client sockets (model files, state, ranks' links)
SWEEP_S = 1.0  # seconds between sweeps, at most
REJECTED_HEAD_S = 2.0  # a connection over the cap gets this long to send the head its 503 answers


@dataclass(frozen=True)
class Limits:
    max_connections: int
    header_timeout: float
    body_timeout: float
    send_timeout: float


def connection_cap(flag: int) -> int:
    """--max-connections, or 0: the soft open-file limit minus FD_RESERVE (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if flag:
        if flag > soft - FD_RESERVE:
            log.warning("--max-connections %d is near or above the open-file limit (%d): connections past the limit "
                        "wait unaccepted; raise it (ulimit -n) or lower --max-connections", flag, soft)
        return flag
    return max(16, min(soft, 1 << 16) - FD_RESERVE)


def protocol_class(limits: Limits) -> type:
    """uvicorn's ``http=`` argument: GuardedH11 bound to ``limits``."""
    return type("GuardedH11", (GuardedH11,), {"limits": limits})


class GuardedH11(H11Protocol):
    limits: Limits

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        now = time.monotonic()
        self._waiting_since = now  # waiting for a request head since (None: a request is in progress)
        self._last_read = now
        self._write_paused_since: float | None = None
        self._head_deadline = self.limits.header_timeout
        _start_sweep(self)
        if len(self.connections) > self.limits.max_connections and not self._evict_idle():
            # every other connection is busy: answer 503 once this head arrives (uvicorn's own check)
            self.limit_concurrency = 0
            self._head_deadline = min(self._head_deadline, REJECTED_HEAD_S)

    def _evict_idle(self) -> bool:
        """Close the connection that has waited longest for a request head; False when none waits."""
        waiting = [c for c in self.connections if c is not self and getattr(c, "_waiting_since", None) is not None]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c._waiting_since)
        log.info("connection cap (%d) reached: closing the connection idle longest", self.limits.max_connections)
        oldest.drop()
        oldest.connections.discard(oldest)
        return True

    def data_received(self, data: bytes) -> None:
        self._last_read = time.monotonic()
        super().data_received(data)
        if self._waiting_since is not None and self.conn.their_state is not h11.IDLE:
            self._waiting_since = None  # a head arrived

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request already
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._waiting_since, self._head_deadline = time.monotonic(), self.limits.header_timeout

    def pause_writing(self) -> None:
        self._write_paused_since = time.monotonic()
        super().pause_writing()

    def resume_writing(self) -> None:
        self._write_paused_since = None
        super().resume_writing()

    def check(self, now: float) -> None:
        """One sweep's look at this connection: close it when one of its clocks ran out."""
        if self.transport.is_closing():
            return
        if self._write_paused_since is not None and now - self._write_paused_since > self.limits.send_timeout:
            log.info("a client left its output unread for %g s: closing its connection", self.limits.send_timeout)
            self.transport.abort()
            return
        if self._waiting_since is not None:
            if now - self._waiting_since > self._head_deadline:
                self.drop()
            return
        reading = self.conn.their_state is h11.SEND_BODY and not self.flow.read_paused
        if reading and self.cycle is not None and not self.cycle.response_started \
                and now - self._last_read > self.limits.body_timeout:
            self.send_408()

    def drop(self) -> None:
        """Close now: gracefully when nothing waits to be sent, else at once (output left unread must
        not keep the socket open)."""
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()

    def send_408(self) -> None:
        body = b"the request body stopped arriving"
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def _start_sweep(proto: GuardedH11) -> None:
    """One repeating sweep per server (kept on uvicorn's shared server state)."""
    state = proto.server_state
    if getattr(state, "_sweeping", False):
        return
    state._sweeping = True
    loop, limits = proto.loop, proto.limits
    every = min(SWEEP_S, limits.header_timeout / 4, limits.body_timeout / 4, limits.send_timeout / 4)

    def sweep() -> None:
        now = time.monotonic()
        for c in list(state.connections):
            if isinstance(c, GuardedH11):
                c.check(now)
        loop.call_later(every, sweep)

    loop.call_later(every, sweep)
