"""What rank 0's engine runs, and where its answers go: the request sources of every face.

A **file source** hands out request files one at a time (:class:`Job`): file mode's inputs
(:class:`FileList`), the Batch API's jobs, the Python API's ``generate_file`` (:class:`QueuedFiles`).
A **request source** (:class:`Requests`) takes requests one by one from other threads and answers
each through its :class:`Live`'s :class:`Channel`. A source says what to run and receives answers; it
never runs the loop.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from tasks.files import count_lines
from tasks.output_file import FileSummary
from tasks.protocol import Answer
from tasks.requests import Request
from tasks.writer import input_id


class RunError(RuntimeError):
    """A problem the user can fix (reported in one line, no traceback)."""


class Busy(Exception):
    """More than --max-pending interactive requests (or --max-pending-rows rows) are waiting: HTTP 429."""


class Unavailable(Exception):
    """The engine is stopping: HTTP 503."""


# -- request files ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """A request file to run: its lines, where the results go, and how many there are."""

    input: str
    output: str
    total: int = 0  # non-blank lines of the input
    input_id: str = ""  # size + hash of the input's start (a journal resumes only against the same input)
    id: str = ""  # the source's own name for it (a batch id)


@dataclass
class FileReport:
    """What became of a file: its counts and figures (``summary``: its summary; None when skipped)."""

    input: str
    output: str
    skipped: bool = False
    requests: int = 0
    errors: int = 0
    error_kinds: dict = field(default_factory=dict)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    summary: FileSummary | None = None


class FileSource:
    """A source of request files; the defaults suit one that only hands files out. The engine tells it
    what became of each: ``opened`` (lines journaled before), ``progress`` (answered and failed lines,
    this run), then ``closed`` with the file's report, ``skipped`` (complete already) or ``failed``."""

    def next_job(self) -> Job | None:
        return None

    def more(self) -> bool:
        """Jobs may still come (False: the engine may end once this source's files are done)."""
        return False

    def tick(self) -> None:
        """Once a turn of the engine's loop (a store's housekeeping)."""

    def paused(self) -> bool:
        """No file opens and no line is read now (a full disk); lines in flight finish."""
        return False

    def cancel_requested(self, job: Job) -> bool:
        return False

    def expired(self, job: Job) -> bool:
        return False

    def opened(self, job: Job, skip: int) -> None:
        pass

    def progress(self, job: Job, answered: int, failed: int) -> None:
        pass

    def closed(self, job: Job, report, expired: bool = False) -> None:
        pass

    def skipped(self, job: Job) -> None:
        pass

    def failed(self, job: Job, message: str | None, detail: str | None = None) -> None:
        """The file could not be run to its end: ``message`` says why to whoever asked for it (None: its
        writer could not write, or did not get every result); ``detail``: the writer's own words (for logs)."""
        raise RunError(message or detail or f"{job.output}: the writer did not receive every result")


class FileList(FileSource):
    """File mode: the inputs, (input, output) each, one after the other; the engine ends after the last."""

    def __init__(self, files: list[tuple[str, str]]):
        self.files = list(files)
        self.reports: list[FileReport] = []
        self.last_output: str | None = None  # of the last file opened

    def next_job(self) -> Job | None:
        if not self.files:
            return None
        source, self.last_output = self.files.pop(0)
        return file_job(source, self.last_output)

    def more(self) -> bool:
        return bool(self.files)

    def closed(self, job: Job, report, expired: bool = False) -> None:
        self.reports.append(report)

    def skipped(self, job: Job) -> None:
        self.reports.append(FileReport(job.input, job.output, skipped=True))


def file_job(input_path: str, output_path: str, job_id: str = "") -> Job:
    return Job(input_path, output_path, count_lines(input_path), input_id(input_path, output_path), job_id)


class QueuedFiles(FileSource):
    """Files handed in from another thread (the Python API's ``generate_file``), each with a future."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.futures: dict[str, Future] = {}
        self._ids = itertools.count()

    def add(self, input_path: str, output_path: str) -> Future:
        job = file_job(input_path, output_path, f"file-{next(self._ids)}")
        fut: Future = Future()
        self.futures[job.id] = fut
        self.jobs.put(job)
        return fut

    def next_job(self) -> Job | None:
        try:
            return self.jobs.get_nowait()
        except queue.Empty:
            return None

    def more(self) -> bool:
        return True

    def closed(self, job: Job, report, expired: bool = False) -> None:
        self.futures.pop(job.id).set_result(report)

    def skipped(self, job: Job) -> None:
        self.futures.pop(job.id).set_result(None)

    def failed(self, job: Job, message: str | None, detail: str | None = None) -> None:
        self.futures.pop(job.id).set_exception(RunError(message or detail or "the writer did not receive every "
                                                        "result"))

    def fail_all(self, message: str) -> None:
        for fut in self.futures.values():
            if not fut.done():
                fut.set_exception(RuntimeError(message))


# -- requests one by one ------------------------------------------------------------------------
class Channel:
    """Where one request's answer goes (the face's; called on the engine's thread). ``keeps_admission``:
    the request counts against admission until the face says it is done with it (a stream being sent)."""

    keeps_admission = False

    def answer(self, answer: Answer) -> None:
        raise NotImplementedError

    def delta(self, choice: int, text: str, logprobs: dict | None, reasoning: str = "") -> None:
        """Text of a streaming request as it is generated (``reasoning``: a thinking chat row's reasoning, apart)."""

    def accepted(self) -> None:
        """The request is queued (a stream may start)."""


class QueueChannel(Channel):
    """Answers and deltas into a queue (``("delta", (choice, text))`` | ``("done", Answer)``)."""

    def __init__(self, stream: bool = False):
        self.events: queue.Queue = queue.Queue()
        self.stream = stream

    def answer(self, answer: Answer) -> None:
        self.events.put(("done", answer))

    def delta(self, choice: int, text: str, logprobs: dict | None, reasoning: str = "") -> None:
        if self.stream and text:
            self.events.put(("delta", (choice, text)))


class FutureChannel(Channel):
    """The answer as a ``concurrent.futures.Future``'s result."""

    def __init__(self):
        self.future: Future = Future()

    def answer(self, answer: Answer) -> None:
        if not self.future.done():
            self.future.set_result(answer)


@dataclass
class Live:
    """One request from its face to its answer."""

    req: Request
    channel: Channel
    stream: bool = False
    rows: int = 1  # prompts x best_of: what it counts against --max-pending-rows
    prompt_ids: list[list[int]] | None = None  # its prompts, tokenized off the engine's thread
    gids: list[int] = field(default_factory=list)  # its scheduler groups (engine thread only)
    admitted: bool = False  # counted in pending/rows until released (source lock)
    started: float = field(default_factory=time.monotonic)  # for /metrics' latencies
    first_at: float | None = None  # streams: when its first text went out


def rows_of(req: Request) -> int:
    """Rows a request occupies while it runs: best_of per prompt (n <= best_of)."""
    return len(req.prompts) * max(req.params.best_of, req.params.n)


class Requests:
    """Requests handed to the engine from other threads, and their answers.

    Admission counts requests (``max_pending``) and rows (``max_rows``) from :meth:`admit` until
    :meth:`release`: a request until it is answered or cancelled, one whose channel keeps admission
    (an HTTP stream) until its face releases it. ``stopping`` refuses new requests (503)."""

    def __init__(self, max_pending: int = 1 << 62, max_rows: int | None = None,
                 stopping: threading.Event | None = None):
        self.max_pending, self.max_rows = max_pending, max_rows
        self.stopping = stopping or threading.Event()
        self.inbox: queue.Queue = queue.Queue()  # Live, or ("cancel", Live)
        self.pending = 0  # admitted and not yet released
        self.rows = 0  # their rows
        self._lock = threading.Lock()
        self._index = itertools.count()

    # -- the faces' side ----------------------------------------------------------------------
    def admit(self, live: Live, number: bool = True) -> None:
        """Count a request in (Busy, Unavailable when it cannot be); it gets its arrival number unless the
        face numbers its requests itself (``number`` false: the Python API's positions in a call, so that
        a sampled request draws the stream a request file's line at that position draws)."""
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
            if number:
                live.req.index = next(self._index)

    def submit(self, live: Live, number: bool = True) -> None:
        """Hand a request (admitted here if it was not) to the engine."""
        if not live.admitted:
            self.admit(live, number)
        self.inbox.put(live)

    def release(self, live: Live) -> None:
        """It no longer counts against admission (idempotent)."""
        with self._lock:
            if live.admitted:
                live.admitted = False
                self.pending -= 1
                self.rows -= live.rows

    def cancel(self, live: Live) -> None:
        """Its client left: the engine frees its rows at its next turn."""
        self.inbox.put(("cancel", live))

    # -- the engine's side --------------------------------------------------------------------
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

    def resolve(self, live: Live, answer: Answer) -> None:
        """Its answer (released with it unless its channel keeps admission until the face is done)."""
        if not live.channel.keeps_admission:
            self.release(live)
        live.channel.answer(answer)
