"""Rank 0's engine on a thread of its own, for the faces that live in this process (the Python API,
the terminal): they call from their thread; when the engine ends, however it ends, every request still
waiting is answered with the reason (``Answer(dead=...)``), so no caller waits forever.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable

from pipeline.runtime.engine import Engine
from pipeline.runtime.sources import Channel, Live, QueuedFiles, Requests, rows_of
from tasks.protocol import Answer
from tasks.requests import Request

log = logging.getLogger(__name__)


class Stopping:
    """This engine's own stop, or an outer one's (the process's signals): set() sets its own only."""

    def __init__(self, outer: threading.Event | None = None):
        self.own, self.outer = threading.Event(), outer

    def is_set(self) -> bool:
        return self.own.is_set() or (self.outer is not None and self.outer.is_set())

    def set(self) -> None:
        self.own.set()


class EngineStopped(RuntimeError):
    """The engine is not running (it failed, or was stopped): nothing more can be submitted."""


class EngineThread:
    def __init__(self, build: Callable[[Requests, QueuedFiles, threading.Event], Engine],
                 stopping: threading.Event | None = None, cleanup: Callable[[bool], None] | None = None):
        """``build``: the engine, made on the engine's thread; ``stopping``: what stops it besides
        :meth:`stop` (the process's signals); ``cleanup(clean)``: after the engine ended (clean: it
        stopped as asked)."""
        self.stopping = Stopping(stopping)
        self.requests = Requests(stopping=self.stopping)
        self.files = QueuedFiles()
        self.engine: Engine | None = None
        self.failure: str | None = None  # why the engine stopped on its own (a traceback's last line)
        self.ready, self.finished = threading.Event(), threading.Event()
        self._build, self._cleanup = build, cleanup
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> EngineThread:
        self.thread.start()
        return self

    def _run(self) -> None:
        clean = False
        try:
            self.engine = self._build(self.requests, self.files, self.stopping)
            self.ready.set()
            self.engine.run()
            clean = True
        except BaseException as e:  # noqa: BLE001 - reported to the face, which raises it
            self.failure = self.failure or f"{type(e).__name__}: {e}"
            log.debug("engine thread: %s", traceback.format_exc())
        finally:
            self._fail_pending()
            self.finished.set()
            if self._cleanup is not None:
                try:
                    self._cleanup(clean)
                except Exception as e:  # noqa: BLE001 - a peer gone at shutdown: torn down anyway
                    log.warning("shutdown: %s", e)

    def _fail_pending(self) -> None:
        """Every request still waiting gets the engine's end (the faces raise it)."""
        dead = Answer(dead=self.failure or "the engine stopped")
        lives = list(self.engine.live.values()) if self.engine is not None else []
        lives += [x for x in self.requests.take() if isinstance(x, Live)]
        for live in lives:
            self.requests.resolve(live, dead)
        self.files.fail_all(dead.dead)

    def submit(self, req: Request, channel: Channel, prompt_ids: list[list[int]] | None = None,
               numbered: bool = False) -> Live:
        """Queue one request (``prompt_ids``: its prompts tokenized on the caller's thread, else the
        engine's driver tokenizes them); its answer comes through ``channel``. ``numbered``: the caller
        gave it its index (unique among its requests in flight), else it gets its arrival number."""
        if self.failure is not None or self.finished.is_set():
            raise EngineStopped(self.failure or "the engine stopped")
        live = Live(req, channel, req.stream, rows=rows_of(req), prompt_ids=prompt_ids)
        self.requests.submit(live, number=not numbered)
        return live

    def cancel(self, live: Live) -> None:
        """Stop working on it (its rows are freed with their micro-batch's next pass)."""
        self.requests.cancel(live)

    def stop(self, timeout: float | None = None) -> None:
        """Finish what runs (bounded by the engine's grace), stop every rank, wait for the thread."""
        self.stopping.set()
        self.thread.join(timeout)
