"""The Batch API's store as rank 0's file source: the oldest unfinished batch is the next request file,
its progress and end are written back to the store.

A batch whose journal was written under other settings (a restart with another --seed, --dtype or
model folder) fails with its answered lines delivered: mixing two settings' answers in one output is
what a journal's fingerprint exists to prevent, and re-running from scratch would throw away what was
answered. A store call that fails (a full disk, any OSError) is logged and never ends the server.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pipeline.runtime.sources import FileSource, Job
from tasks.writer import input_id, journal_path, journal_problem

from tasks.batch_store import BatchStore

log = logging.getLogger("serve")

SWEEP_EVERY = 60.0  # seconds between deletions of expired files and batches
# what a client reads when its batch cannot go on (the server's log has the details, with paths)
SETTINGS_CHANGED = ("the server was restarted with other settings (model, seed or dtype) than this batch started "
                    "with; its answered requests are in the output file, the others in the error file: resubmit those")
WRITE_FAILED = "the server could not write this batch's results; the requests answered before are in the output file"
DISK_FULL = ("the server's disk filled up while writing this batch's results; the answered requests are in the "
             "output file")


class BatchJobs(FileSource):
    def __init__(self, store: BatchStore, fingerprint: dict | None = None):
        self.store, self.fingerprint = store, fingerprint
        self._swept = 0.0

    def more(self) -> bool:
        return True

    def tick(self) -> None:
        if time.monotonic() - self._swept >= SWEEP_EVERY:
            self._swept = time.monotonic()
            self._store(self.store.sweep)

    def paused(self) -> bool:
        return self.store.disk_low()  # a full disk pauses batches; interactive requests go on

    def next_job(self) -> Job | None:
        job = self._store(self.store.next_job)
        if job is None:
            return None
        if Path(job.output).exists():  # complete: the server stopped before the batch was marked so
            self._store(self.store.finish, job.id)
            return None
        try:
            ident = input_id(job.input, job.output)
        except OSError as e:  # its input is gone or unreadable: the batch fails, the server goes on
            log.error("batch %s: cannot read its input: %s", job.id, e)
            self._store(self.store.fail, job.id, "the server cannot read this batch's input file")
            return None
        if self.fingerprint is not None:
            if problem := journal_problem(journal_path(job.output), dict(self.fingerprint, input=ident)):
                log.error("batch %s: %s; it fails with its answered lines delivered", job.id, problem)
                self._store(self.store.fail, job.id, SETTINGS_CHANGED)
                return None
        return Job(job.input, job.output, job.total, ident, job.id)

    def cancel_requested(self, job: Job) -> bool:
        return self.store.cancel_requested(job.id)

    def expired(self, job: Job) -> bool:
        return self.store.is_expired(job.id)

    def opened(self, job: Job, skip: int) -> None:
        self._store(self.store.started, job.id, skip)
        if skip:
            log.info("batch %s: resuming after %d answered requests", job.id, skip)

    def progress(self, job: Job, answered: int, failed: int) -> None:
        self.store.progress(job.id, answered, failed)

    def closed(self, job: Job, report, expired: bool = False) -> None:
        self._deliver(job.id, None, expired)

    def skipped(self, job: Job) -> None:
        self._deliver(job.id, None)

    def failed(self, job: Job, message: str | None, detail: str | None = None) -> None:
        if detail:
            log.error("batch %s: %s", job.id, detail)
        self._deliver(job.id, message or (DISK_FULL if self.store.disk_low() else WRITE_FAILED))

    def _store(self, method, *args):
        """A store call that writes: a full disk (or any OSError) is logged, never ends the server."""
        try:
            return method(*args)
        except OSError as e:
            log.error("batch state: %s (%s); batches wait for the disk", e, getattr(method, "__name__", method))
            return None

    def _deliver(self, bid: str, error: str | None, expired: bool = False) -> None:
        """The batch's output files, and its status: completed (cancelled, expired), else failed with ``error``.
        A delivery that raises (not only a full disk) fails the batch without its output; the server goes on."""
        try:
            if error:
                self.store.fail(bid, error)
            else:
                self.store.finish(bid, expired)
        except OSError as e:
            log.error("batch state: %s (delivering %s); batches wait for the disk", e, bid)
        except Exception as e:
            log.error("batch %s: %s: %s", bid, type(e).__name__, e)
            self._store(self.store.fail, bid, f"its output could not be delivered ({type(e).__name__})", False)
