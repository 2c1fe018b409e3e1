"""Rank 0's loop: for each request file, open it down the pipeline, keep every micro-batch slot
busy with passes built by the :class:`~pipeline.scheduling.driver.Driver`, take the replies that ring back,
and close the file when its last request is answered.

With one process (P = 1) rank 0 is also the last stage: its messages go straight to the
:class:`~pipeline.runtime.last_rank.LastRank` in this process instead of over the network.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from comm.faults import DRIVE
from tasks.output_file import FileSummary
from tasks.shards import index_of
from tasks.writer import input_id

from pipeline.scheduling.driver import Driver, read_lines
from pipeline.runtime.last_rank import LastRank
from pipeline.runtime.link import Link
from pipeline.runtime.retry import Retry
from pipeline.runtime.messages import CloseFile, Closed, Message, OpenFile, Opened, PassHeader, Reply, Stop
from pipeline.runtime.stage import Stage, allocate_ahead, pack

log = logging.getLogger(__name__)


class RunError(RuntimeError):
    """A problem the user can fix (reported in one line, no traceback)."""


@dataclass
class Job:
    input: str
    output: str


@dataclass
class FileReport:
    input: str
    output: str
    skipped: bool = False
    requests: int = 0
    errors: int = 0
    error_kinds: dict = field(default_factory=dict)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    summary: FileSummary | None = None  # None when skipped


class FirstRank:
    def __init__(self, stage: Stage, driver: Driver, link: Link | None, last=None, data_rank: int = 0,
                 data_size: int = 1):
        assert (link is None) == (last is not None), "a pipeline of one stage has no link; longer ones have one"
        self.stage, self.driver, self.link, self.last = stage, driver, link, last
        self.data_rank, self.data_size = data_rank, data_size
        self.local: deque[Message] = deque()  # P = 1: the last stage's answers
        self.stats_every = 0.0  # seconds between passes that collect the stages' figures (0: never)
        self._stats_at = 0.0
        self.retry = Retry(self._compute, self._receive, driver.group_of, driver.prefix)  # a pass whose forward raised

    def drive(self, jobs: list[Job]) -> list[FileReport]:
        """Run every file; the last message tells every rank to stop."""
        reports = []
        for job in jobs:
            total = sum(1 for _ in read_lines(job.input))
            self.stage.busy, self.stage.peak_cells = 0.0, self.stage.kv_cells
            self._down(OpenFile(job.input, job.output, total, input_id(job.input, job.output)))
            opened = self._reply()
            assert isinstance(opened, Opened)
            if opened.error:
                raise RunError(opened.error)
            if opened.skip is None:
                log.warning("%s: complete output exists at %s, skipping (--overwrite recomputes)", job.input, job.output)
                reports.append(FileReport(job.input, job.output, skipped=True))
                continue
            reports.append(self._run_file(job, opened.skip, total, opened.suspects, opened.culprits))
        self._down(Stop())
        if self.link is not None:
            self.link.flush()
        return reports

    def _run_file(self, job: Job, done: int, total: int, suspects=(), culprits=()) -> FileReport:
        t0 = time.perf_counter()
        d = self.driver
        # `done` counts this share's finished lines; read from its next one on (tasks/shards.py)
        d.start(read_lines(job.input, skip=index_of(self.data_rank, done, self.data_size)), suspects, culprits)
        if done:
            log.info("%s: resuming after %d finished requests", job.input, done)
        inflight = 0
        ahead = self.link is not None  # several stages: a slot computing prompts has a second pass in flight
        while True:
            d.fill()
            for sid in d.slot_ids:
                while True:  # one pass, then a second one ahead of its answer if it computes prompts only
                    # (Scheduler.next_pass(ahead=True)), or at the end of a file the passes its decode rows split over
                    busy = d.busy(sid)
                    built = d.next_pass(sid, ahead)
                    if built is None:
                        break
                    self._launch_pass(*built, busy)
                    inflight += 1
                    d.fill()
            if inflight == 0:
                if d.done:
                    break
                raise RuntimeError("scheduler stalled with queued requests and nothing in flight")
            reply = self._reply()
            assert isinstance(reply, Reply)
            inflight -= 1
            DRIVE.tick()
            d.on_reply(reply)  # a slot it empties is released with the next pass (or the close)
        return self._close(job, total, t0)

    def _close(self, job: Job, total: int, t0: float) -> FileReport:
        d = self.driver
        release = d.take_released()
        self.stage.release(release)
        self._down(CloseFile(total, d.requests_read, d.error_kinds, d.encode_seconds, d.padding_ratio, release,
                             d.take_errors(),
                             busy=[self.stage.busy], gpu_peak_mb=self.stage.gpu_peak_mb(),
                             precision=[self.stage.precision()], memory=[self.stage.memory_mb()]))
        closed = self._reply()
        assert isinstance(closed, Closed)
        if not closed.complete:
            raise RuntimeError(f"{job.output}: the writer did not receive every result")
        s = closed.summary
        return FileReport(job.input, job.output, requests=d.requests_read, errors=s.errors,
                          error_kinds=dict(s.error_kinds), prompt_tokens=s.prompt_tokens,
                          generated_tokens=s.completion_tokens, seconds=time.perf_counter() - t0, summary=s)

    def _launch_pass(self, hdr: PassHeader, dec: torch.Tensor | None, pre: torch.Tensor | None,
                     ahead: bool = False) -> None:
        """Compute a built pass on this stage and send it down (the other ranks told first when it
        allocates its cache: :func:`~pipeline.runtime.stage.allocate_ahead`)."""
        allocate_ahead(self.link, hdr)
        if self.stats_every and time.monotonic() - self._stats_at >= self.stats_every:
            self._stats_at = time.monotonic()
            hdr.stats = []  # each stage appends its figures (pipeline.runtime.monitor reads them)
        admitting = LastRank.admitting(hdr)  # the lines it admits are recorded before any stage computes them
        if self.last is not None:
            self.last.record(admitting)
        elif admitting is not None:
            self.link.send_next_now(admitting)
        self.retry.sending(hdr, dec, pre)
        self._compute(hdr, dec, pre, ahead)

    def _compute(self, hdr: PassHeader, dec: torch.Tensor | None, pre: torch.Tensor | None,
                 ahead: bool = False) -> None:
        self._down(hdr, self.stage.step(hdr, pack([t for t in (dec, pre) if t is not None]), ahead))

    def _down(self, msg: Message, x: torch.Tensor | None = None) -> None:
        """To the next stage; with P = 1 straight to the last stage's handler."""
        if self.last is None:
            self.link.send_next(msg, x)
            return
        reply = self.last.handle(msg, x)
        if reply is not None:
            self.local.append(reply)

    def _reply(self) -> Message:
        """The next answer from the last stage (a failed pass's replaced by its retry's: pipeline.runtime.retry)."""
        return self.retry.next()

    def _receive(self) -> Message:
        return self.local.popleft() if self.last is not None else self.link.recv_last()
