"""Rank 0 in the caller's process: serve mode's pipeline loop (:class:`serve.engine.ServeRank`) in a
thread, fed by Python calls instead of HTTP clients.

:class:`ApiSource` is serve mode's :class:`~serve.source.RequestSource` with thread-safe answers
(``concurrent.futures.Future`` instead of an asyncio future); :class:`FileQueue` stands in for the
Batch API's store, so :meth:`LLM.generate_file` runs a request file through the same OpenFile /
CloseFile path, writer and journal as file mode. Nothing here schedules, samples or formats: the
driver, scheduler, head and writer are the runner's.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass

from comm.dist import init_distributed, shutdown
from pipeline.runtime.roles import first_rank, load_stage, run_budget
from serve.engine import ServeRank
from serve.source import Live, RequestSource
from serve.store_records import BatchJob

log = logging.getLogger("api")


class ApiSource(RequestSource):
    """Requests from Python calls: each :class:`Live` carries a ``concurrent.futures.Future``."""

    def __init__(self):
        super().__init__(max_pending=1 << 62)
        self.stopping = threading.Event()  # this engine's, not the process's SIGTERM flag

    def resolve(self, live: Live, value: tuple) -> None:
        if not live.future.done():
            live.future.set_result(value)

    def accept(self, live: Live) -> None:
        pass

    def emit(self, live: Live, choice: int, text: str, logprobs: dict | None = None) -> None:
        pass  # results are whole requests (LLM.stream yields each as it finishes)

    def forget(self, live: Live) -> None:
        pass


class FileQueue:
    """The part of :class:`serve.batches.BatchStore` the engine calls, for :meth:`LLM.generate_file`."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.done: dict[str, Future] = {}
        self._ids = itertools.count()

    def add(self, input_path: str, output_path: str, total: int) -> Future:
        bid = f"file-{next(self._ids)}"
        fut: Future = Future()
        self.done[bid] = fut
        self.jobs.put(BatchJob(bid, input_path, output_path, total))
        return fut

    def next_job(self) -> BatchJob | None:
        try:
            return self.jobs.get_nowait()
        except queue.Empty:
            return None

    def finish(self, bid: str, expired: bool = False) -> None:
        self.done.pop(bid).set_result(None)

    def fail(self, bid: str, message: str, deliver: bool = True) -> None:
        self.done.pop(bid).set_exception(RuntimeError(message))

    def sweep(self) -> None:
        pass

    def disk_low(self) -> bool:
        return False

    def cancel_requested(self, bid: str) -> bool:
        return False

    def is_expired(self, bid: str) -> bool:
        return False

    def started(self, bid: str, skip: int) -> None:
        pass

    def progress(self, bid: str, completed: int, failed: int) -> None:
        pass


@dataclass
class Loaded:
    """Rank 0's pieces once loaded."""

    engine: ServeRank
    info: object  # comm.dist.DistInfo
    tokenizer: object


class Engine:
    """Rank 0's loop in a daemon thread: :meth:`start` loads (raising what loading raised), :meth:`stop`
    sends Stop to every stage and meets them at the shutdown barrier."""

    def __init__(self, plan, opts):
        self.plan, self.opts = plan, opts
        self.source, self.files = ApiSource(), FileQueue()
        self.loaded: Loaded | None = None
        self.failure: str | None = None  # why the engine stopped (a traceback's last line, a worker's message)
        self.ready, self.finished = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="pipeline", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        clean, info = False, None
        try:
            info = init_distributed(self.opts.rank, self.opts.world_size, self.opts.pipeline_group_size,
                                    self.opts.data_group_size, self.opts.dist_url, self.opts.cuda_id, self.opts.timeout,
                                    self.opts.dist_backend)
            stage = load_stage(self.plan, self.opts, info)
            self.opts.budget = run_budget(self.opts, info, stage, self.plan)
            fr = first_rank(self.plan, self.opts, info, stage, arriving=True)  # serve mode's policy
            engine = ServeRank(fr.stage, fr.driver, fr.link, fr.last, self.source, self.files)
            engine.fingerprint = self.plan.fingerprint
            self.loaded = Loaded(engine, info, fr.driver.tok)
            self.ready.set()
            engine.serve()
            clean = True
        except BaseException as e:  # noqa: BLE001 - reported to the caller, who raises it
            self.failure = self.failure or f"{type(e).__name__}: {e}"
            log.debug("pipeline thread: %s", traceback.format_exc())
        finally:
            self._fail_pending()
            self.finished.set()
            try:
                if info is not None and info.backend is not None:  # one stage has no group (another LLM's may exist)
                    shutdown(info, clean)
            except Exception as e:  # noqa: BLE001 - a peer gone at shutdown: the group is torn down anyway
                log.warning("shutdown: %s", e)

    def _fail_pending(self) -> None:
        """Every request still waiting gets the engine's failure (the callers raise it)."""
        engine = self.loaded.engine if self.loaded else None
        lives = list(engine.live.values()) if engine else []
        lives += [x for x in self.source.take() if isinstance(x, Live)]
        for live in lives:
            self.source.resolve(live, ("dead", self.failure or "the engine stopped"))
        for fut in list(self.files.done.values()):
            if not fut.done():
                fut.set_exception(RuntimeError(self.failure or "the engine stopped"))

    def stop(self, timeout: float) -> None:
        """Let in-flight requests finish, stop every stage; returns after ``timeout`` seconds at most."""
        self.source.stopping.set()
        self.thread.join(timeout)
