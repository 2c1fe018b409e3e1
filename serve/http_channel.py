"""The hand-off between an HTTP handler (asyncio) and rank 0's engine (a plain thread): the engine answers
through an :class:`HttpChannel`, which hops back onto the HTTP loop with ``call_soon_threadsafe``.
Nothing else is shared.
"""

from __future__ import annotations

import asyncio

from pipeline.runtime.sources import Channel
from tasks.protocol import Answer

STREAM_BUFFER = 512  # text deltas a stream holds for a client that does not read; later ones wait for the end


class HttpChannel(Channel):
    """One HTTP request's way back: ``future`` -> its :class:`~tasks.protocol.Answer`; a stream's text
    deltas ``(choice, text, logprobs, reasoning)`` in ``events``, and ``queued`` set once it is accepted (until
    then an error is still a plain HTTP error, not an event). A stream keeps counting against admission
    until its response ends (the handler releases it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: bool = False):
        self.loop, self.stream = loop, stream
        self.future: asyncio.Future = loop.create_future()
        self.events: asyncio.Queue | None = asyncio.Queue(STREAM_BUFFER) if stream else None
        self.queued: asyncio.Future | None = loop.create_future() if stream else None
        self.overflow = False  # its stream buffer filled: later deltas wait for the final chunk (HTTP loop)
        self.keeps_admission = stream

    def answer(self, answer: Answer) -> None:
        self.loop.call_soon_threadsafe(_set_result, self.future, answer)

    def accepted(self) -> None:
        if self.queued is not None:
            self.loop.call_soon_threadsafe(_set_result, self.queued, True)

    def delta(self, choice: int, text: str, logprobs: dict | None, reasoning: str = "") -> None:
        if self.events is not None and (text or reasoning):
            self.loop.call_soon_threadsafe(self._put, (choice, text, logprobs, reasoning))

    def _put(self, item: tuple) -> None:
        """A delta into the stream's bounded buffer. Once it is full (the client does not read), the
        deltas that follow are not kept: the final chunk of each choice carries all text and logprobs not
        sent (serve.sse), so the stream stays whole while its buffer stays bounded."""
        if self.overflow or self.events.full():
            self.overflow = True
            return
        self.events.put_nowait(item)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
