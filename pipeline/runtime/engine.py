"""Rank 0's engine: the one loop behind every face.

Fed by sources (:mod:`pipeline.runtime.sources`), each turn it takes the new requests (ahead of file
lines), steps the open file, launches a pass for every ready slot (readiness by event: a slot is tried
when its answer comes back, the idle ones when work is queued), then handles one answer from the last
rank. Stopping (``stopping`` set) takes one path (docs/design/architecture.md): nothing new is admitted,
queued work leaves, rows a checkpoint cannot keep get ``grace`` seconds, then :class:`Stop` goes down.
With P = 1 the last rank is in this process: messages go straight to its handler.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from comm.faults import DRIVE
from tasks.protocol import Answer, server_error
from tasks.requests import parse_request
from tasks.shards import index_of

from pipeline.runtime.last_rank import LastRank
from pipeline.runtime.messages import (Allocate, CloseFile, Closed, Message, OpenFile, Opened, PassHeader, Release,
                                       Reply, Stop)
from pipeline.runtime.retry import Retry
from pipeline.runtime.sources import FileReport, FileSource, Job, Live, Requests
from pipeline.runtime.stage import Stage, pack
from pipeline.scheduling.driver import Driver, read_lines
from pipeline.scheduling.intake import as_request_error

log = logging.getLogger(__name__)

SHUTDOWN_GRACE = 20.0  # seconds the rows in flight get to finish once the engine stops
POLL_S = 0.2  # seconds between looks at a file source's own state (cancels, expiry, a full disk)


@dataclass
class FileRun:
    """The open file."""

    job: Job
    opened: bool = False
    closing: bool = False
    cancelled: bool = False
    expiring: bool = False  # its source's window passed: no more lines, it ends "expired"
    error: str | None = None  # it cannot go on: closed with what it has and failed
    skip: int = 0  # lines journaled before this run
    kept: int = 0  # lines an earlier run answered that its checkpoint kept (not read again)
    done: int = 0  # results written in this run
    reported: tuple[int, int] | None = None  # (done, errors) its source was last told
    started: float = field(default_factory=time.perf_counter)


class Engine:
    def __init__(self, stage: Stage, driver: Driver, link, last: LastRank | None = None,
                 files: FileSource | None = None, requests: Requests | None = None,
                 stopping: threading.Event | None = None, data_rank: int = 0, data_size: int = 1):
        assert (link is None) == (last is not None), "a pipeline of one stage has no link; longer ones have one"
        self.stage, self.driver, self.link, self.last = stage, driver, link, last
        self.files, self.requests = files, requests
        self.stopping = stopping or (requests.stopping if requests is not None else threading.Event())
        self.data_rank, self.data_size = data_rank, data_size
        self.local: deque[Message] = deque()  # P = 1: the last stage's answers
        self.retry = Retry(self._compute, self._receive, driver.group_of, driver.prefix)  # a pass whose forward raised
        self.flight = [0] * len(driver.slot_ids)  # passes in flight per slot
        self.ready: set[int] = set(driver.slot_ids)  # slots to try at the next launch
        self.owed = 0  # answers the last rank owes: passes, OpenFile, CloseFile
        self.live: dict[int, Live] = {}  # request index -> a request in the scheduler
        self.job: FileRun | None = None
        self.grace = SHUTDOWN_GRACE
        self.stats_every = 0.0  # seconds between passes that collect the stages' figures (0: never)
        self._stats_at = 0.0
        self.metrics = None  # serve mode's /metrics (serve.metrics.ServeMetrics)
        self._load_at = 0.0
        self._polled, self._paused = -POLL_S, False

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        """Until every source is done, or until stopped (then drained within ``grace``)."""
        deadline = None
        while True:
            if deadline is None and self.stopping.is_set():
                deadline = time.monotonic() + self.grace
                self._shed()
            if self.requests is not None:
                self._take(self.requests.take())
            if deadline is None:
                self._file_step()
            if deadline is None or (self.driver.unresumable and time.monotonic() < deadline):
                self._launch()  # stopping: only while rows a checkpoint cannot keep are in flight
            if self.owed == 0:
                if deadline is not None or self._finished():
                    break
                self._idle()
                continue
            self._on(self.retry.next())  # the last stage's next answer (a failed pass's: its retry's)
        self._stop()

    def _finished(self) -> bool:
        return self.requests is None and self.job is None and not (self.files is not None and self.files.more())

    def _idle(self) -> None:
        """Nothing in flight: the emptied slots' caches freed on every stage (no pass will carry their
        release), the load gauges at rest; then wait for a request, or (files alone) the open file cannot go on."""
        released = self.driver.take_released()
        if released:
            self.stage.release(released)
            if self.link is not None:
                self.link.send_next(Release(released))
            if self.metrics is not None:
                self.metrics.idle(self.stage.kv_cells)
        if self.metrics is not None and self._load_at >= 0:
            self._set_load(-1.0)  # at rest: measured again with the next pass's answer
        if self.requests is not None:
            self._take(self.requests.take(timeout=0.05))
        elif self.job is not None and self.job.opened and not self.job.closing:
            raise RuntimeError("scheduler stalled with queued requests and nothing in flight")

    def _stop(self) -> None:
        for live in self.live.values():
            self.requests.resolve(live, Answer(error=server_error("the server shut down before this request "
                                                                   "finished", 503)))
        self.live.clear()
        self._down(Stop())
        if self.link is not None:
            self.link.flush()

    # -- requests -----------------------------------------------------------------------------
    def _take(self, items: list) -> None:
        for item in items:
            if isinstance(item, tuple):
                self.cancel(item[1])
                continue
            if self.stopping.is_set():
                self.requests.resolve(item, Answer(error=server_error("the server is shutting down", 503)))
                continue
            try:
                item.gids = self.driver.submit_live(item.req, item.prompt_ids)  # tokenized on the face's thread
            except Exception as e:  # a request that cannot be prepared is answered, the engine goes on
                self.requests.resolve(item, Answer(error=as_request_error(e)))
                continue
            item.prompt_ids = None  # the driver keeps them now
            self.live[item.req.index] = item
            item.channel.accepted()
            self._new_work()

    def cancel(self, live: Live) -> None:
        """Its client left: unqueued groups leave the queue, admitted rows are dropped with their slot's next pass."""
        if self.live.get(live.req.index) is not live:
            return  # answered already (its index may be a later request's now)
        del self.live[live.req.index]
        self.requests.release(live)
        held = self.driver.cancel(set(live.gids), live.req.index)
        log.info("request %d: the client left; its rows are freed (%d micro-batch(es))", live.req.index, held)

    def _shed(self) -> None:
        """Stopping: nothing queued starts; a file's lines come back from its journal on the next run."""
        for meta in self.driver.shed():
            live = self.live.pop(meta.req, None) if meta.live else None
            if live is not None:
                self.requests.resolve(live, Answer(error=server_error("the server is shutting down", 503)))

    # -- files --------------------------------------------------------------------------------
    def _file_step(self) -> None:
        if self.files is None:
            return
        j, d, now = self.job, self.driver, time.monotonic()
        if now >= self._polled + POLL_S:  # the source's own state (a store's cancels, expiry, disk): a few times a second
            self._polled = now
            self._poll_files()
        if j is None:
            if not self._paused:
                self._open_next()
            return
        if not j.opened or j.closing:
            return
        if not d.exhausted and not self._paused:
            self._fill()
        answered = (j.done, sum(d.error_kinds.values()))
        if answered != j.reported:
            j.reported = answered
            self.files.progress(j.job, *answered)
            if d.exhausted and sum(answered) == d.requests_read:
                self._close(j)

    def _poll_files(self) -> None:
        self.files.tick()
        self._paused = self.files.paused()
        j, d = self.job, self.driver
        if j is None or not j.opened or j.closing or j.cancelled or j.expiring:
            return
        if self.files.cancel_requested(j.job):
            j.cancelled = True
            started = d.cancel_file()
            log.info("%s: cancelled; %d lines in flight end with their next passes, the queued ones never start",
                     j.job.id or j.job.input, started)
        elif self.files.expired(j.job):
            log.warning("%s: its completion window passed; it ends expired with what it answered", j.job.id)
            j.expiring, d.lines = True, None
        else:
            return
        j.reported = None  # look at the counts again: it may close now

    def _fill(self) -> None:
        """Read the open file's lines into the driver's window; reading that fails closes the file failed."""
        d, j = self.driver, self.job
        queued = d.queued
        try:
            d.fill()
        except Exception as e:  # noqa: BLE001 - its input failed: close with what it has, mark it failed
            log.error("%s: %s: %s", j.job.input, type(e).__name__, e)
            j.error = f"the file stopped after {j.skip + j.kept + d.requests_read} lines: {type(e).__name__}"
            j.cancelled, d.lines = True, None
            d.isolation.aside.clear()
        if d.queued != queued:
            self._new_work()

    def _open_next(self) -> None:
        job = self.files.next_job()
        if job is None:
            return
        self.job = FileRun(job)
        self.stage.busy, self.stage.peak_cells = 0.0, self.stage.kv_cells  # this file's figures
        self._down(OpenFile(job.input, job.output, job.total, job.input_id))
        self.owed += 1

    def _opened(self, msg: Opened) -> None:
        j = self.job
        if msg.error:
            self.job = None
            self.files.failed(j.job, None, msg.error)
        elif msg.skip is None:  # its output is complete
            self.job = None
            log.warning("%s: complete output exists at %s, skipping (--overwrite recomputes)", j.job.input,
                        j.job.output)
            self.files.skipped(j.job)
        else:
            j.opened, j.skip, j.kept, j.started = True, msg.skip, len(msg.answered), time.perf_counter()
            # ``skip`` counts this share's journaled lines; read from its next one on (tasks/shards.py),
            # leaving out the lines a checkpoint kept answered
            lines = read_lines(j.job.input, skip=index_of(self.data_rank, msg.skip, self.data_size))
            if msg.answered:
                answered = set(msg.answered)
                lines = (item for item in lines if item[0] not in answered)
            self.driver.start(lines, msg.suspects, msg.culprits, msg.resume)
            if msg.skip or msg.resume or msg.answered:
                log.info("%s: resuming after %d finished requests%s%s", j.job.input, msg.skip + len(msg.answered),
                         f" ({len(msg.answered)} kept by the last checkpoint)" if msg.answered else "",
                         f", {len(msg.resume)} rows where they stopped" if msg.resume else "")
            self.files.opened(j.job, msg.skip + len(msg.answered))

    def _close(self, j: FileRun) -> None:
        d = self.driver
        release = d.take_released()
        self.stage.release(release)
        total = j.skip + j.kept + d.requests_read if (j.cancelled or j.expiring) else j.job.total
        msg = CloseFile(total, d.requests_read, d.error_kinds, d.encode_seconds, d.padding_ratio, release,
                        d.take_errors(), ignored_fields=dict(d.ignored_fields))
        self.stage.add_figures(msg)  # every later stage appends its own on the way down
        self._down(msg)
        j.closing = True
        self.owed += 1

    def _closed(self, msg: Closed) -> None:
        j, self.job = self.job, None
        d, s = self.driver, msg.summary
        d.lines = None
        if self.metrics is not None:
            self.metrics.tokens(s.prompt_tokens, s.completion_tokens)
        report = FileReport(j.job.input, j.job.output, requests=d.requests_read, errors=s.errors,
                            error_kinds=dict(s.error_kinds), prompt_tokens=s.prompt_tokens,
                            generated_tokens=s.completion_tokens, seconds=time.perf_counter() - j.started, summary=s)
        if j.error:
            self.files.failed(j.job, j.error)
        elif msg.complete:
            self.files.closed(j.job, report, j.expiring and not j.cancelled)
        else:
            self.files.failed(j.job, None)

    # -- passes -------------------------------------------------------------------------------
    def _new_work(self) -> None:
        """Groups were queued: every slot without a pass in flight may take them."""
        self.ready.update(s for s, n in enumerate(self.flight) if n == 0)

    def _launch(self) -> None:
        todo, self.ready = self.ready, set()
        d = self.driver
        for sid in sorted(todo):
            while True:  # a pass, then while several stages compute a second one ahead of its answer
                # (Scheduler.next_pass(ahead=True): prompts only, or a file's last decode rows split)
                busy = self.flight[sid] > 0
                if busy and self.link is None:  # one stage: no second pass in flight
                    break
                built = d.next_pass(sid, busy)
                if built is None:
                    break
                self._launch_pass(*built, busy)
                self.flight[sid] += 1
                self.owed += 1
                if self.job is not None and not d.exhausted:
                    self._fill()

    def _launch_pass(self, hdr: PassHeader, dec: torch.Tensor | None, pre: torch.Tensor | None,
                     ahead: bool = False) -> None:
        """Compute a built pass on this stage and send it down. A pass that allocates its slot's cache
        tells the other ranks first, so that they allocate theirs now (:class:`Allocate`); not one that
        resizes the prefix pool: a pool dropped to make room for this cache must go first (the pass does that)."""
        if hdr.alloc and self.link is not None and hdr.keeps_cache and hdr.prefix_grow is None:
            self.link.send_next(Allocate(hdr.slot, *hdr.alloc, release=list(hdr.release)))
        if self.stats_every and time.monotonic() - self._stats_at >= self.stats_every:
            self._stats_at = time.monotonic()
            hdr.stats = []  # each stage appends its figures (pipeline.runtime.monitor reads them)
        admitting = LastRank.admitting(hdr) if hdr.admit else None  # recorded before any stage computes them
        if admitting is not None:
            if self.last is not None:
                self.last.record(admitting)
            else:
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

    # -- answers ------------------------------------------------------------------------------
    def _receive(self) -> Message:
        return self.local.popleft() if self.last is not None else self.link.recv_last()

    def _on(self, msg: Message) -> None:
        self.owed -= 1
        if isinstance(msg, Opened):
            return self._opened(msg)
        if isinstance(msg, Closed):
            return self._closed(msg)
        assert isinstance(msg, Reply), msg
        if DRIVE.armed:
            DRIVE.tick()
        self.flight[msg.slot] -= 1
        self.ready.add(msg.slot)
        if self.driver.on_reply(msg):  # a slot emptied, or work waits: the idle ones may take it
            self._new_work()
        for index, choice, text, logprobs, reasoning in msg.deltas:
            live = self.live.get(index)
            if live is not None:
                if live.first_at is None and self.metrics is not None:
                    live.first_at = time.monotonic()
                    self.metrics.first_token(live.started)
                live.channel.delta(choice, text, logprobs, reasoning)
        for item in msg.retry:
            self._rerun(*item)
        for index, body in msg.answers:
            live = self.live.pop(index, None)
            if live is not None:
                answer = Answer.from_wire(body)
                if self.metrics is not None and answer.ok:
                    self.metrics.answered(live.started, answer.result.get("usage"), live.first_at)
                self.requests.resolve(live, answer)
        if self.job is not None:
            self.job.done += msg.written
        if self.metrics is not None:
            self._measure(msg)

    def _rerun(self, live: bool, index: int, raw, budget: int, max_tokens: int, room: int) -> None:
        """--retry-starved: a request whose thinking starved its answer runs once more, with a larger
        thinking budget and max_tokens (pipeline.output.answers); its line (or answer) is the rerun's."""
        item = self.live.get(index) if live else None
        if live and item is None:  # its client left meanwhile
            return
        try:
            req = item.req if live else parse_request(raw, index)
            gids = self.driver.rerun(req, budget, max_tokens, room, live)
        except Exception as e:  # noqa: BLE001 - it cannot run again: answered with the error, the run goes on
            if live:
                self.live.pop(index, None)
                self.requests.resolve(item, Answer(error=as_request_error(e)))
            else:
                self.driver.error_line(index, raw, as_request_error(e))
            return
        if live:
            item.gids = gids
        self._new_work()

    def _measure(self, msg: Reply) -> None:
        """/metrics: the stages' figures a pass brought back; the scheduler's load at most twice a second."""
        if msg.stats:
            self.metrics.on_stats(msg.stats)
        now = time.monotonic()
        if 0 <= now - self._load_at < 0.5:
            return
        self._set_load(now)

    def _set_load(self, at: float) -> None:
        """/metrics' load gauges from the scheduler now; ``at``: when (-1: at rest)."""
        self._load_at, d, prefix = at, self.driver, self.driver.prefix
        self.metrics.set_load(d.queued, d.running_rows, len(self.live), prefix.hit_tokens if prefix else 0,
                              prefix.prompt_tokens if prefix else 0)
