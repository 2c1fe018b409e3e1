"""Rank 0's loop in serve mode: the file-mode driver and scheduler, fed by HTTP clients and batches.

Each turn takes what the HTTP thread queued (new requests go ahead of batch lines; a request that
cannot run is answered at once), reads the running batch's next lines, launches a pass for every
idle micro-batch slot, and then handles one answer from the last rank. Answers arrive in the order
their messages went down the pipeline, so :class:`OpenFile` / :class:`CloseFile` for a batch
interleave freely with passes: a batch opens, runs and closes while interactive traffic goes on.
With P = 1 the last rank is in this process (``FirstRank._down`` hands messages to it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.scheduling.driver import read_lines
from pipeline.runtime.first_rank import FirstRank
from pipeline.scheduling.intake import as_request_error
from pipeline.runtime.messages import CloseFile, Closed, Message, OpenFile, Opened, Reply, Stop
from tasks.requests import RequestError
from tasks.writer import input_id, journal_path, journal_problem

from serve.batches import BatchJob, BatchStore
from serve.source import Live, RequestSource

log = logging.getLogger(__name__)

SHUTDOWN_GRACE = 20.0  # seconds in-flight requests get to finish after SIGTERM
SWEEP_EVERY = 60.0  # seconds between deletions of expired files and batches
# what a client reads when its batch cannot go on (the server's log has the details, with paths)
SETTINGS_CHANGED = ("the server was restarted with other settings (model, seed or dtype) than this batch started "
                    "with; its answered requests are in the output file, the others in the error file: resubmit those")
WRITE_FAILED = "the server could not write this batch's results; the requests answered before are in the output file"
DISK_FULL = ("the server's disk filled up while writing this batch's results; the answered requests are in the "
             "output file")


@dataclass
class BatchRun:
    job: BatchJob
    opened: bool = False
    closing: bool = False
    cancelled: bool = False
    expiring: bool = False  # its completion window passed: no more lines, it ends "expired"
    error: str | None = None  # it cannot go on: closed with what it has and marked failed
    skip: int = 0  # lines journaled before this run
    done: int = 0  # results written in this run


class ServeRank(FirstRank):
    def __init__(self, stage, driver, link, last, source: RequestSource, batches: BatchStore):
        super().__init__(stage, driver, link, last)
        self.source, self.batches = source, batches
        self.owed = 0  # answers the last rank owes: passes, OpenFile, CloseFile
        self.live: dict[int, Live] = {}  # request index -> a request in the scheduler
        self.batch: BatchRun | None = None
        self.fingerprint: dict | None = None  # the run's (pipeline.config.plan): a batch's journal resumes only under it
        self.metrics = None  # serve.metrics.ServeMetrics: /metrics
        self._load_at = 0.0
        self._swept = 0.0

    def serve(self) -> None:
        """Until SIGTERM: then stop taking work, let in-flight requests finish (bounded), stop every rank."""
        deadline = None
        while True:
            if deadline is None and self.source.stopping.is_set():
                deadline = time.monotonic() + SHUTDOWN_GRACE
                self._shed()
            self._take(self.source.take())
            if deadline is None:
                self._batch_step()
            if deadline is None or time.monotonic() < deadline:
                self._launch()
            if self.owed == 0:
                if deadline is not None:
                    break
                self._take(self.source.take(timeout=0.05))
                continue
            self._on(self._reply())
        for live in self.live.values():
            self.source.resolve(live, ("error", 503, _error("the server shut down before this request finished",
                                                           "server_error")))
        self._down(Stop())
        if self.link is not None:
            self.link.flush()

    # -- interactive requests -----------------------------------------------------------------
    def _take(self, items: list) -> None:
        for item in items:
            if isinstance(item, tuple):
                self._cancel(item[1])
                continue
            if self.source.stopping.is_set():
                self.source.resolve(item, ("error", 503, _error("the server is shutting down", "server_error")))
                continue
            try:
                item.gids = self.driver.submit_live(item.req, item.prompt_ids)  # tokenized on the HTTP side
            except Exception as e:  # a request that cannot be prepared is answered, the server goes on
                err = as_request_error(e)
                self.source.resolve(item, ("error", 400 if err.kind == "invalid_request_error" else 500, err.to_dict()))
                continue
            item.prompt_ids = None  # the driver keeps them now
            self.live[item.req.index] = item
            self.source.accept(item)

    def _cancel(self, live: Live) -> None:
        """Its client left: unqueued groups leave the queue, admitted rows are dropped with their slot's next pass."""
        if self.live.pop(live.req.index, None) is None:
            return  # answered already
        self.source.forget(live)
        held = self.driver.cancel(set(live.gids), live.req.index)
        log.info("request %d: the client left; its rows are freed (%d micro-batch(es))", live.req.index, held)

    def _shed(self) -> None:
        """Shutdown: nothing queued starts (batch lines come back from the journal after a restart)."""
        for meta in self.driver.shed():
            if meta.live and meta.req in self.live:
                live = self.live.pop(meta.req)
                self.source.resolve(live, ("error", 503, _error("the server is shutting down", "server_error")))

    # -- passes and answers -------------------------------------------------------------------
    def _launch(self) -> None:
        for sid in self.driver.slot_ids:
            built = self.driver.next_pass(sid)  # None while its pass is in flight (no passes ahead here)
            if built is not None:
                self._launch_pass(*built)
                self.owed += 1

    def _on(self, msg: Message) -> None:
        self.owed -= 1
        if isinstance(msg, Opened):
            return self._opened(msg)
        if isinstance(msg, Closed):
            return self._closed(msg)
        assert isinstance(msg, Reply), msg
        self.driver.on_reply(msg)  # a slot it empties is released with the next pass
        for index, choice, text, logprobs in msg.deltas:
            live = self.live.get(index)
            if live is not None:
                if live.first_at is None and self.metrics is not None:
                    live.first_at = time.monotonic()
                    self.metrics.first_token(live.started)
                self.source.emit(live, choice, text, logprobs)
        for index, line in msg.answers:
            live = self.live.pop(index, None)
            if live is not None:  # a request whose computation failed gets its error, the others go on
                if self.metrics is not None and line.get("error") is None:
                    self.metrics.answered(live.started, line["result"].get("usage"), live.first_at)
                err = line.get("error")  # the request's own (a grammar that could not go on): 400, else 500
                status = 400 if err is not None and err.get("type") == "invalid_request_error" else 500
                self.source.resolve(live, ("ok", line) if err is None else ("error", status, err))
        if self.metrics is not None:
            self._measure(msg)
        if self.batch is not None:
            self.batch.done += msg.written

    def _measure(self, msg: Reply) -> None:
        """/metrics: the stages' figures a pass brought back; the scheduler's load at most twice a second."""
        if msg.stats:
            self.metrics.on_stats(msg.stats)
        now = time.monotonic()
        if now - self._load_at < 0.5:
            return
        self._load_at = now
        d, prefix = self.driver, self.driver.prefix
        self.metrics.set_load(d.queued, d.running_rows, len(self.live), prefix.hit_tokens if prefix else 0,
                              prefix.prompt_tokens if prefix else 0)

    # -- the running batch --------------------------------------------------------------------
    def _batch_step(self) -> None:
        d, b = self.driver, self.batch
        if time.monotonic() - self._swept >= SWEEP_EVERY:
            self._swept = time.monotonic()
            self._store(self.batches.sweep)
        if b is None:
            if not self.batches.disk_low():  # a full disk pauses batches; interactive requests go on
                self._open_next()
            return
        if not b.opened or b.closing:
            return
        if not (b.cancelled or b.expiring):
            if self.batches.cancel_requested(b.job.id):
                b.cancelled, d.lines = True, None
            elif self.batches.is_expired(b.job.id):
                log.warning("batch %s: its completion window passed; it ends expired with what it answered", b.job.id)
                b.expiring, d.lines = True, None
        if d.lines is not None and self.batches.disk_low():
            return  # paused: no new lines until there is space again (those in flight finish)
        try:
            d.fill()
        except Exception as e:  # reading its input failed: close with what it has, mark it failed
            log.error("batch %s: %s: %s", b.job.id, type(e).__name__, e)
            b.error = f"the batch stopped after {b.skip + d.requests_read} lines: {type(e).__name__}"
            b.cancelled, d.lines, d.held = True, None, None
        errors = sum(d.error_kinds.values())
        self.batches.progress(b.job.id, b.done, errors)
        if d.exhausted and b.done + errors == d.requests_read:
            total = b.skip + d.requests_read if (b.cancelled or b.expiring) else b.job.total
            self._down(CloseFile(total, d.requests_read, d.error_kinds, d.encode_seconds, 0.0, [], d.take_errors(),
                                 busy=[self.stage.busy], gpu_peak_mb=self.stage.gpu_peak_mb(),
                                 memory=[self.stage.memory_mb()]))
            self.owed += 1
            b.closing = True

    def _open_next(self) -> None:
        """Start the next batch, unless its journal was written under other settings (a restart with
        another --seed, --dtype or model folder): then it fails with its answered lines delivered, since
        mixing two settings' answers in one output is what a journal's fingerprint exists to prevent, and
        re-running from scratch would throw away what was answered."""
        job = self._store(self.batches.next_job)
        if job is None:
            return
        if Path(job.output).exists():  # complete: the server stopped before the batch was marked so
            self._store(self.batches.finish, job.id)
            return
        try:
            ident = input_id(job.input, job.output)
        except OSError as e:  # its input is gone or unreadable: the batch fails, the server goes on
            log.error("batch %s: cannot read its input: %s", job.id, e)
            self._store(self.batches.fail, job.id, "the server cannot read this batch's input file")
            return
        if self.fingerprint is not None:
            problem = journal_problem(journal_path(job.output), dict(self.fingerprint, input=ident))
            if problem:
                log.error("batch %s: %s; it fails with its answered lines delivered", job.id, problem)
                self._store(self.batches.fail, job.id, SETTINGS_CHANGED)
                return
        self.batch = BatchRun(job)
        self._down(OpenFile(job.input, job.output, job.total, ident))
        self.owed += 1

    def _store(self, method, *args):
        """A store call that writes: a full disk (or any OSError) is logged, never ends the server."""
        try:
            return method(*args)
        except OSError as e:
            log.error("batch state: %s (%s); batches wait for the disk", e, getattr(method, "__name__", method))
            return None

    def _opened(self, msg: Opened) -> None:
        b = self.batch
        if msg.error:
            log.error("batch %s: %s", b.job.id, msg.error)
            self._store(self.batches.fail, b.job.id, WRITE_FAILED)
            self.batch = None
        elif msg.skip is None:  # its output is complete (the server stopped before the batch was marked so)
            self.batch = None
            self._deliver(b.job.id, None)
        else:
            b.opened, b.skip = True, msg.skip
            self.driver.start(read_lines(b.job.input, skip=msg.skip), msg.suspects, msg.culprits)
            self._store(self.batches.started, b.job.id, msg.skip)
            if msg.skip:
                log.info("batch %s: resuming after %d answered requests", b.job.id, msg.skip)

    def _closed(self, msg: Closed) -> None:
        b, self.batch = self.batch, None
        if self.metrics is not None:
            self.metrics.tokens(msg.summary.prompt_tokens, msg.summary.completion_tokens)
        self.driver.lines = None
        if b.error:
            self._deliver(b.job.id, b.error)
        elif msg.complete:
            self._deliver(b.job.id, None, b.expiring and not b.cancelled)
        else:
            self._deliver(b.job.id, DISK_FULL if self.batches.disk_low() else WRITE_FAILED)

    def _deliver(self, bid: str, error: str | None, expired: bool = False) -> None:
        """The batch's output files, and its status: completed (cancelled, expired), else failed with ``error``.
        A delivery that raises (not only a full disk) fails the batch without its output; the server goes on."""
        try:
            if error:
                self.batches.fail(bid, error)
            else:
                self.batches.finish(bid, expired)
        except OSError as e:
            log.error("batch state: %s (delivering %s); batches wait for the disk", e, bid)
        except Exception as e:
            log.error("batch %s: %s: %s", bid, type(e).__name__, e)
            self._store(self.batches.fail, bid, f"its output could not be delivered ({type(e).__name__})", False)


def _error(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"message": message, "type": kind, "param": param}
