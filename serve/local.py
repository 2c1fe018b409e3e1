"""Requests from this process (``--prompts``, ``--chat``) into serve mode's engine, answers back.

The terminal faces are one more source feeding rank 0's intake (docs/design: one engine, many
faces): :class:`LocalEngine` runs :class:`serve.engine.ServeRank` (the scheduler, the passes, the
answers and stream deltas the last rank sends back) on a pipeline thread, and the terminal thread
submits requests through a :class:`LocalSource`, which answers into plain queues instead of an
HTTP server's asyncio loop. At P = 1 the last stage runs on the pipeline thread too; at P > 1 the
answers ring back from the last rank exactly as they do for HTTP clients.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from pipeline.scheduling.intake import as_request_error
from tasks.requests import RequestError, parse_body

from serve.engine import ServeRank
from serve.intake import rows_of
from serve.source import Live, RequestSource

log = logging.getLogger("serve")


class LocalSource(RequestSource):
    """A :class:`RequestSource` whose answers go to each request's own queue (no asyncio)."""

    def resolve(self, live: Live, value: tuple) -> None:
        self.release(live)
        live.events.put(("done", value))

    def accept(self, live: Live) -> None:
        pass

    def emit(self, live: Live, choice: int, text: str, logprobs: dict | None = None) -> None:
        if live.stream and text:
            live.events.put(("delta", (choice, text)))


@dataclass
class Ticket:
    """One submitted request: its events (("delta", (choice, text)) | ("done", value)) and timings."""

    live: Live
    submitted: float
    encode_seconds: float
    prompt_tokens: int
    finished: float | None = None
    value: tuple | None = None
    text: dict[int, str] = field(default_factory=dict)


class _LocalRank(ServeRank):
    """Serve mode's loop without the Batch API (no store: only this process's requests)."""

    def _batch_step(self) -> None:
        pass


class LocalEngine:
    """Serve mode's engine on a pipeline thread, fed from this process. ``stop()`` drains and stops
    every rank (the engine sends :class:`~pipeline.runtime.messages.Stop` down the pipeline)."""

    def __init__(self, fr, max_pending: int = 256):
        self.source = LocalSource(max_pending)
        self.source.stopping = threading.Event()  # this face's own: serve mode's STOPPING is SIGTERM's
        self.engine = _LocalRank(fr.stage, fr.driver, fr.link, fr.last, self.source, None)
        self.driver = fr.driver
        self.tok = _own_copy(fr.driver.tok)  # the terminal thread's: the pipeline thread detokenizes with its own
        self.max_positions = fr.driver.max_positions
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="pipeline", daemon=True)

    def start(self) -> "LocalEngine":
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            self.engine.serve()
        except BaseException as e:  # noqa: BLE001 - the terminal thread reports it and exits non-zero
            self.error = e
            self.source.stopping.set()

    def stop(self, timeout: float | None = None) -> None:
        """Finish what runs, tell every rank to stop, wait for the pipeline thread."""
        self.source.stopping.set()
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, body: dict, chat: bool, stream: bool = False) -> Ticket:
        """Parse, tokenize (on this thread) and queue one request; RequestError when it cannot run."""
        if self.error is not None or not self.alive:
            raise RuntimeError(f"the pipeline stopped: {self.error}")
        req = parse_body(body, chat)
        req.stream = stream
        t0 = time.perf_counter()
        try:
            ids = self.driver.encode_prompts(req, self.tok)
        except Exception as e:  # noqa: BLE001 - the request's own error
            raise as_request_error(e) from None
        t1 = time.perf_counter()
        live = Live(req, None, None, stream, queue.Queue(), None, rows=rows_of(req), prompt_ids=ids)
        self.source.submit(live)
        return Ticket(live, time.perf_counter(), t1 - t0, sum(len(i) for i in ids))

    def events(self, ticket: Ticket, timeout: float = 0.05):
        """The ticket's next event, or None after ``timeout`` (raises when the pipeline thread died)."""
        try:
            kind, value = ticket.live.events.get(timeout=timeout)
        except queue.Empty:
            if not self.alive:
                raise RuntimeError(f"the pipeline stopped: {self.error}") from self.error
            return None
        if kind == "delta":
            choice, text = value
            ticket.text[choice] = ticket.text.get(choice, "") + text
        else:
            ticket.finished, ticket.value = time.perf_counter(), value
        return kind, value

    def wait(self, ticket: Ticket) -> tuple:
        """Its answer: ("ok", output line) | ("error", status, error object)."""
        while ticket.value is None:
            self.events(ticket, 0.2)
        return ticket.value

    def cancel(self, ticket: Ticket) -> None:
        """Stop generating for it (its rows are freed with their micro-batch's next pass)."""
        if ticket.value is None:
            self.source.cancel(ticket.live)


def error_of(value: tuple) -> RequestError | None:
    """The request's error from an answer, None when it was answered."""
    if value[0] == "ok":
        return None
    err = value[2]
    return RequestError(err.get("message", "failed"), err.get("param"), err.get("type", "server_error"))


def _own_copy(tok):
    try:  # a fast tokenizer must not be used by two threads at once
        return copy.deepcopy(tok)
    except Exception:  # noqa: BLE001 - not copyable: share it (encoding only reads it)
        return tok
