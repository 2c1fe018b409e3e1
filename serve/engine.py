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

from pipeline.driver import input_fingerprint, read_lines
from pipeline.intake import as_request_error
from pipeline.first_rank import FirstRank
from pipeline.messages import CloseFile, Closed, Message, OpenFile, Opened, Reply, Stop

from .batches import BatchJob, BatchStore
from .source import Live, RequestSource

log = logging.getLogger(__name__)

SHUTDOWN_GRACE = 20.0  # seconds in-flight requests get to finish after SIGTERM


@dataclass
class BatchRun:
    job: BatchJob
    opened: bool = False
    closing: bool = False
    cancelled: bool = False
    error: str | None = None  # it cannot go on: closed with what it has and marked failed
    skip: int = 0  # lines journaled before this run
    done: int = 0  # results written in this run


class ServeRank(FirstRank):
    def __init__(self, stage, driver, link, last, source: RequestSource, batches: BatchStore):
        super().__init__(stage, driver, link, last)
        self.source, self.batches = source, batches
        self.owed = 0  # answers the last rank owes: passes, OpenFile, CloseFile
        self.live: dict[int, Live] = {}  # request index -> a request in the scheduler
        self.drops: dict[int, set[int]] = {}  # slot -> live requests to forget with its next pass
        self.release: list[int] = []
        self.batch: BatchRun | None = None

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
                item.gids = self.driver.submit_live(item.req)
            except Exception as e:  # a request that cannot be prepared is answered, the server goes on
                err = as_request_error(e)
                self.source.resolve(item, ("error", 400 if err.kind == "invalid_request_error" else 500, err.to_dict()))
                continue
            self.live[item.req.index] = item
            self.source.accept(item)

    def _cancel(self, live: Live) -> None:
        """Its client left: unqueued groups leave the queue, admitted rows are dropped with their slot's next pass."""
        if self.live.pop(live.req.index, None) is None:
            return  # answered already
        self.source.forget(live)
        gids, sched = set(live.gids), self.driver.sched
        for g in [g for g in sched.queue if g.gid in gids]:
            sched.queue.remove(g)
            self.driver.unqueue(g)
        held = [slot.sid for slot in sched.slots if gids.intersection(x for x in slot.row_group if x is not None)]
        for sid in held:
            self.drops.setdefault(sid, set()).add(live.req.index)
        log.info("request %d: the client left; its rows are freed (%d micro-batch(es))", live.req.index, len(held))

    def _shed(self) -> None:
        """Shutdown: nothing queued starts (batch lines come back from the journal after a restart)."""
        sched = self.driver.sched
        for g in list(sched.queue):
            meta = self.driver.unqueue(g)
            if meta is not None and meta.live and meta.req in self.live:
                live = self.live.pop(meta.req)
                self.source.resolve(live, ("error", 503, _error("the server is shutting down", "server_error")))
        sched.queue.clear()
        self.driver.lines = None

    # -- passes and answers -------------------------------------------------------------------
    def _launch(self) -> None:
        d, sched = self.driver, self.driver.sched
        for slot in sched.slots:
            ps = None if slot.inflight else sched.next_pass(slot.sid)
            if ps is None:
                if not slot.inflight:
                    self.drops.pop(slot.sid, None)
                continue
            hdr, dec, pre = d.build(ps, self.release)
            self.release = []
            hdr.drop = sorted(self.drops.pop(slot.sid, ()))
            self._launch_pass(hdr, dec, pre)
            self.owed += 1

    def _on(self, msg: Message) -> None:
        self.owed -= 1
        if isinstance(msg, Opened):
            return self._opened(msg)
        if isinstance(msg, Closed):
            return self._closed(msg)
        assert isinstance(msg, Reply), msg
        sched = self.driver.sched
        was = sched.slots[msg.slot].allocated
        self.driver.on_reply(msg)
        if was and not sched.slots[msg.slot].allocated:
            self.release.append(msg.slot)
        for index, choice, text, logprobs in msg.deltas:
            live = self.live.get(index)
            if live is not None:
                self.source.emit(live, choice, text, logprobs)
        for index, line in msg.answers:
            live = self.live.pop(index, None)
            if live is not None:  # a request whose computation failed gets its error, the others go on
                self.source.resolve(live, ("ok", line) if line.get("error") is None else ("error", 500, line["error"]))
        if self.batch is not None:
            self.batch.done += msg.written

    # -- the running batch --------------------------------------------------------------------
    def _batch_step(self) -> None:
        d, b = self.driver, self.batch
        if b is None:
            job = self.batches.next_job()
            if job is not None:
                try:
                    fingerprint = input_fingerprint(job.input)
                except OSError as e:  # its input is gone: the batch fails, the server goes on
                    self.batches.fail(job.id, f"cannot read the batch's input file: {e.strerror or e}")
                    return
                self.batch = BatchRun(job)
                self._down(OpenFile(job.input, job.output, job.total, fingerprint))
                self.owed += 1
            return
        if not b.opened or b.closing:
            return
        if not b.cancelled and self.batches.cancel_requested(b.job.id):
            b.cancelled, d.lines = True, None
        try:
            d.fill()
        except Exception as e:  # reading its input failed: close with what it has, mark it failed
            log.error("batch %s: %s: %s", b.job.id, type(e).__name__, e)
            b.error = f"the batch stopped after {b.skip + d.requests_read} lines: {type(e).__name__}: {str(e)[:200]}"
            b.cancelled, d.lines, d.held = True, None, None
        errors = sum(d.error_kinds.values())
        self.batches.progress(b.job.id, b.done, errors)
        if d.exhausted and b.done + errors == d.requests_read:
            total = b.skip + d.requests_read if b.cancelled else b.job.total
            self._down(CloseFile(total, d.requests_read, d.error_kinds, d.encode_seconds, 0.0, [], d.take_errors(),
                                 busy=[self.stage.busy], gpu_peak_mb=self.stage.gpu_peak_mb()))
            self.owed += 1
            b.closing = True

    def _opened(self, msg: Opened) -> None:
        b = self.batch
        if msg.error:
            log.error("batch %s: %s", b.job.id, msg.error)
            self.batches.fail(b.job.id, msg.error)
            self.batch = None
        elif msg.skip is None:  # its output is complete (the server stopped before the batch was marked so)
            self.batch = None
            self._deliver(b.job.id, None)
        else:
            b.opened, b.skip = True, msg.skip
            self.driver.start(read_lines(b.job.input, skip=msg.skip), msg.suspects, msg.culprits)
            try:
                self.batches.started(b.job.id, msg.skip)
            except Exception as e:  # a journal it cannot read: counted as answered; the batch goes on
                log.warning("batch %s: %s: %s", b.job.id, type(e).__name__, e)
            if msg.skip:
                log.info("batch %s: resuming after %d answered requests", b.job.id, msg.skip)

    def _closed(self, msg: Closed) -> None:
        b, self.batch = self.batch, None
        self.driver.lines = None
        self._deliver(b.job.id, b.error or (None if msg.complete else "the writer did not receive every result"))

    def _deliver(self, bid: str, error: str | None) -> None:
        """The batch's output files, and its status: completed (or cancelled), else failed with ``error``."""
        try:
            if error:
                self.batches.fail(bid, error)
            else:
                self.batches.finish(bid)
        except Exception as e:  # its output cannot be delivered: failed, the server goes on
            log.error("batch %s: %s: %s", bid, type(e).__name__, e)
            self.batches.fail(bid, f"its output could not be delivered ({type(e).__name__})", deliver=False)


def _error(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"message": message, "type": kind, "param": param}
