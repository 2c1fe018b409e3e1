"""The handoff between the HTTP thread (asyncio) and rank 0's pipeline loop (one plain thread).

An HTTP handler wraps a parsed request in a :class:`Live` with an asyncio future and an event
queue, and :meth:`RequestSource.submit` puts it in a thread-safe inbox. The pipeline loop takes
it from there, and answers through :meth:`RequestSource.resolve` / :meth:`RequestSource.emit`,
which hop back onto the HTTP loop with ``call_soon_threadsafe``. Nothing else is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

from tasks.requests import Request

STOPPING = threading.Event()  # set by SIGTERM/SIGINT in serve mode: stop accepting, drain, exit
_OWN_STOP = threading.local()  # .event: what stops a server started on this thread instead (stopped_by)


@contextlib.contextmanager
def stopped_by(event: threading.Event):
    """Serve mode started on this thread inside the block stops when ``event`` is set instead of on SIGTERM's
    :data:`STOPPING`: several servers in one process (``--in-process`` servers of a test run) each have a
    stop of their own, and none is left set for the next one."""
    _OWN_STOP.event = event
    try:
        yield event
    finally:
        _OWN_STOP.event = None


def stop_event() -> threading.Event:
    """What stops a server started on this thread: :data:`STOPPING`, unless :func:`stopped_by` gave another."""
    return getattr(_OWN_STOP, "event", None) or STOPPING


STREAM_BUFFER = 512  # text deltas a stream holds for a client that does not read; later ones wait for the end


class Busy(Exception):
    """More than --max-pending interactive requests (or --max-pending-rows rows) are waiting: HTTP 429."""


class Unavailable(Exception):
    """The server is shutting down: HTTP 503."""


@dataclass
class Live:
    """One interactive request, from its HTTP handler to its answer."""

    req: Request
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future  # -> ("ok", output line) | ("error", status, error object)
    stream: bool = False
    events: asyncio.Queue | None = None  # streaming: (choice index, text delta, its logprobs) as tokens come
    accepted: asyncio.Future | None = None  # streaming: set once tokenized and queued (else `future` errs)
    gids: list[int] = field(default_factory=list)  # its scheduler groups (pipeline thread only)
    streamed: dict[int, int] = field(default_factory=dict)  # choice -> characters sent (pipeline thread)
    rows: int = 1  # prompts x best_of: what it counts against --max-pending-rows
    prompt_ids: list[list[int]] | None = None  # its prompts, tokenized off the pipeline thread
    admitted: bool = False  # counted in pending/rows until released (source lock)
    overflow: bool = False  # its stream buffer filled: later deltas wait for the final chunk (HTTP loop)
    started: float = field(default_factory=time.monotonic)  # for /metrics' latencies (serve.metrics)
    first_at: float | None = None  # streams: when its first text went out


class RequestSource:
    """Admission counts requests (--max-pending) and rows (--max-pending-rows) from :meth:`admit` until
    :meth:`release`: a plain request until it is answered or its client left, a stream until its last
    byte is sent or its client left (an unread stream keeps counting)."""

    def __init__(self, max_pending: int, max_rows: int | None = None):
        self.max_pending, self.max_rows = max_pending, max_rows
        self.inbox: queue.Queue = queue.Queue()  # Live, or ("cancel", Live)
        self.pending = 0  # admitted and not yet released
        self.rows = 0  # their rows
        self._lock = threading.Lock()
        self._index = itertools.count()
        self.stopping = stop_event()  # rank 0's thread builds it (serve.run)

    # -- HTTP thread --------------------------------------------------------------------------
    def admit(self, live: Live) -> None:
        """Count a request in (Busy, Unavailable when it cannot be); it gets its arrival number."""
        with self._lock:
            if self.stopping.is_set():
                raise Unavailable("the server is shutting down")
            if self.pending >= self.max_pending:
                raise Busy(f"more than --max-pending {self.max_pending} requests are waiting; retry shortly")
            if self.max_rows is not None and self.pending and self.rows + live.rows > self.max_rows:
                raise Busy(f"more than --max-pending-rows {self.max_rows} rows (prompts x best_of) are waiting; "
                           "retry shortly")
            self.pending += 1
            self.rows += live.rows
            live.admitted = True
            live.req.index = next(self._index)

    def submit(self, live: Live) -> None:
        """Hand an admitted request (admitted here if it was not) to the pipeline thread."""
        if not live.admitted:
            self.admit(live)
        self.inbox.put(live)

    def release(self, live: Live) -> None:
        """It no longer counts against admission (idempotent)."""
        with self._lock:
            if live.admitted:
                live.admitted = False
                self.pending -= 1
                self.rows -= live.rows

    def cancel(self, live: Live) -> None:
        """The client left: free its rows (the pipeline thread does it at its next turn)."""
        self.inbox.put(("cancel", live))

    # -- pipeline thread ----------------------------------------------------------------------
    def take(self, timeout: float | None = None) -> list:
        """Everything in the inbox; waits up to ``timeout`` for the first item when given."""
        items = []
        try:
            items.append(self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait())
            while True:
                items.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return items

    def resolve(self, live: Live, value: tuple) -> None:
        """Its answer; a plain request is released with it (a stream when its response ends)."""
        if not live.stream:
            self.release(live)
        live.loop.call_soon_threadsafe(_set_result, live.future, value)

    def forget(self, live: Live) -> None:
        """A cancelled request: no answer is owed."""
        self.release(live)

    def accept(self, live: Live) -> None:
        if live.accepted is not None:
            live.loop.call_soon_threadsafe(_set_result, live.accepted, True)

    def emit(self, live: Live, choice: int, text: str, logprobs: dict | None = None) -> None:
        if live.events is not None and text:
            live.loop.call_soon_threadsafe(_put, live, (choice, text, logprobs))


def _put(live: Live, item: tuple) -> None:
    """A delta into a stream's bounded buffer. Once it is full (the client does not read), the deltas
    that follow are not kept: the final chunk of each choice carries all text and logprobs not sent
    (serve.sse), so the stream stays whole while its buffer stays bounded."""
    if live.overflow or live.events.full():
        live.overflow = True
        return
    live.events.put_nowait(item)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
