"""The handoff between the HTTP thread (asyncio) and rank 0's pipeline loop (one plain thread).

An HTTP handler wraps a parsed request in a :class:`Live` with an asyncio future and an event
queue, and :meth:`RequestSource.submit` puts it in a thread-safe inbox. The pipeline loop takes
it from there, and answers through :meth:`RequestSource.resolve` / :meth:`RequestSource.emit`,
which hop back onto the HTTP loop with ``call_soon_threadsafe``. Nothing else is shared.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from dataclasses import dataclass, field

from tasks.requests import Request

STOPPING = threading.Event()  # set by SIGTERM/SIGINT in serve mode: stop accepting, drain, exit


class Busy(Exception):
    """More than --max-pending interactive requests are waiting: HTTP 429."""


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


class RequestSource:
    def __init__(self, max_pending: int):
        self.max_pending = max_pending
        self.inbox: queue.Queue = queue.Queue()  # Live, or ("cancel", Live)
        self.pending = 0  # accepted and not yet answered
        self._lock = threading.Lock()
        self._index = itertools.count()
        self.stopping = STOPPING

    # -- HTTP thread --------------------------------------------------------------------------
    def submit(self, live: Live) -> None:
        with self._lock:
            if self.stopping.is_set():
                raise Unavailable("the server is shutting down")
            if self.pending >= self.max_pending:
                raise Busy(f"more than --max-pending {self.max_pending} requests are waiting; retry shortly")
            self.pending += 1
            live.req.index = next(self._index)
        self.inbox.put(live)

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
        with self._lock:
            self.pending -= 1
        live.loop.call_soon_threadsafe(_set_result, live.future, value)

    def forget(self, live: Live) -> None:
        """A cancelled request: no answer is owed."""
        with self._lock:
            self.pending -= 1

    def accept(self, live: Live) -> None:
        if live.accepted is not None:
            live.loop.call_soon_threadsafe(_set_result, live.accepted, True)

    def emit(self, live: Live, choice: int, text: str, logprobs: dict | None = None) -> None:
        if live.events is not None and text:
            live.loop.call_soon_threadsafe(live.events.put_nowait, (choice, text, logprobs))


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
