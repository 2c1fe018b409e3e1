"""The terminal's requests (``--prompts``, ``--chat``) on the pipeline loaded in this process: rank 0's
engine runs on a thread of its own and the requests, tokenized here with a copy of the tokenizer, come
from this one; at P > 1 the answers ring back from the last rank as they do for HTTP clients.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

from pipeline.loading.tokenizer import own_copy
from pipeline.runtime.engine_thread import EngineThread
from pipeline.runtime.roles import make_engine
from pipeline.runtime.sources import Live, QueueChannel
from pipeline.scheduling.intake import as_request_error
from tasks.protocol import Answer, RequestError
from tasks.requests import parse_body


@dataclass
class Ticket:
    """One submitted request: its events and timings; ``text``: choice -> the text streamed so far."""

    live: Live
    submitted: float
    encode_seconds: float
    finished: float | None = None
    answer: Answer | None = None
    text: dict[int, str] = field(default_factory=dict)


class LocalEngine:
    """``rank``'s engine on a thread, fed from this one; ``thread.stop()`` drains and stops every rank."""

    def __init__(self, rank, stopping=None):
        self.thread = EngineThread(lambda req, files, stop: make_engine(rank, None, req, stop, arriving=True), stopping)
        self.thread.start()
        self.thread.ready.wait()  # built from loaded parts: at once, or failed
        engine = self.thread.engine
        if engine is None:
            raise RuntimeError(f"the pipeline stopped: {self.thread.failure}")
        self.driver = engine.driver
        self.tok = own_copy(self.driver.tok)  # this thread's: the engine's thread detokenizes with its own

    def submit(self, body: dict, chat: bool, stream: bool = False) -> Ticket:
        """Parse, tokenize (on this thread) and queue one request; RequestError when it cannot run."""
        req = parse_body(body, chat)
        req.stream = stream
        t0 = time.perf_counter()
        try:
            ids = self.driver.encode_prompts(req, self.tok)
        except Exception as e:  # noqa: BLE001 - the request's own error
            raise as_request_error(e) from None
        encode_seconds = time.perf_counter() - t0
        return Ticket(self.thread.submit(req, QueueChannel(stream), ids), time.perf_counter(), encode_seconds)

    def events(self, ticket: Ticket, timeout: float = 0.05):
        """The ticket's next event, or None after ``timeout``."""
        try:
            kind, value = ticket.live.channel.events.get(timeout=timeout)
        except queue.Empty:
            return None
        if kind == "delta":
            choice, text = value
            ticket.text[choice] = ticket.text.get(choice, "") + text
        else:
            ticket.finished, ticket.answer = time.perf_counter(), value
        return kind, value

    def wait(self, ticket: Ticket) -> Answer:
        while ticket.answer is None:
            self.events(ticket, 0.2)
        return ticket.answer

    def cancel(self, ticket: Ticket) -> None:
        """Stop generating for it (its rows are freed with their micro-batch's next pass)."""
        if ticket.answer is None:
            self.thread.cancel(ticket.live)


def error_of(answer: Answer) -> RequestError | None:
    """The request's error from an answer (the engine's end as a server error), None when it was answered."""
    if answer.ok:
        return None
    return answer.error or RequestError(f"the pipeline stopped: {answer.dead}", kind="server_error")

