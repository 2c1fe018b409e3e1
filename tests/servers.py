"""Servers for tests. Serve mode in the test process: :class:`LocalServer` runs
``dist_inference_runner.main([... "--serve", "127.0.0.1:PORT", "--in-process", "--pipeline-group-size", P])``
on a thread (every rank a thread, the same rank loops and messages as under torchrun, a real uvicorn
socket), so a test talks HTTP to it as to a process.

Shared servers: :class:`Servers` (the session fixture ``servers``) starts ONE server per configuration
(:data:`CONFIGS` x P) for the whole test run, on first use, and stops them at the end. Every test that only
talks HTTP to a server shares it; each test takes a key of its own (:meth:`LocalServer.key`) from the
server's key file, so its files and batches live in a namespace of their own (tasks/batch_store.py: another
key's ids answer 404). What every test sharing a server must leave as it found it: nothing running (join
its threads, let its batches end or cancel them) and no change to the server itself. A test that stops,
restarts or changes a server starts its own :class:`LocalServer` (a few seconds) instead. docs/testing.md
says how to write one. :class:`ProcessServer`: the runner's processes, for what only processes show.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.utils import RUNNER, _env, free_port, wait_served

try:  # the HTTP client the openai package (a declared test dependency) brings: httpx, or its fork httpx2
    import httpx
except ImportError:
    import httpx2 as httpx

KEYS = 256  # keys in a shared server's key file: one or a few per test
START_SECONDS = 300


class LogTail(logging.Handler):
    """The project's log records of this process, kept (the last 20,000) for tests to look for a line.
    Every in-process server logs here: a test looks only at lines logged since it began (:meth:`mark`)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: collections.deque[str] = collections.deque(maxlen=20_000)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = record.getMessage()
            if record.exc_info:  # what a process would have printed: the traceback too
                line += "\n" + logging.Formatter().formatException(record.exc_info)
            self.lines.append(line)
            self.count += 1
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is not a test's concern
            pass

    def mark(self) -> int:
        return self.count

    def since(self, mark: int) -> str:
        new = self.count - mark
        return "\n".join(list(self.lines)[-new:]) if new > 0 else ""

    def wait_for(self, text: str, since: int, seconds: float = 30) -> None:
        deadline = time.monotonic() + seconds
        while text not in self.since(since):
            assert time.monotonic() < deadline, f"{text!r} was not logged within {seconds} s"
            time.sleep(0.05)


LOG = LogTail()
_LOGGERS = ("serve", "runner", "pipeline", "tasks", "comm")  # the project's loggers: their INFO lines are kept
_SHARED = {"servers": 0, "umask": 0, "levels": {}}  # what servers running in this process changed, to undo
_SHARED_LOCK = threading.Lock()


def _enter_process() -> None:
    """The first server of the process: the project's INFO lines go to :data:`LOG` (a server's log)."""
    with _SHARED_LOCK:
        if _SHARED["servers"] == 0:
            _SHARED["umask"] = os.umask(0o077)  # serve.server sets it too: what a serving process has
            os.umask(_SHARED["umask"])
            _SHARED["levels"] = {n: logging.getLogger(n).level for n in _LOGGERS}
            for name in _LOGGERS:  # on the project's loggers, not the root: the root's handlers stay pytest's
                if logging.getLogger(name).getEffectiveLevel() > logging.INFO:
                    logging.getLogger(name).setLevel(logging.INFO)
                logging.getLogger(name).addHandler(LOG)
        _SHARED["servers"] += 1


def _leave_process() -> None:
    """The last server of the process stopped: its umask (serve.server's 077), log levels and handler undone."""
    with _SHARED_LOCK:
        _SHARED["servers"] -= 1
        if _SHARED["servers"] == 0:
            os.umask(_SHARED["umask"])
            for name, level in _SHARED["levels"].items():
                logging.getLogger(name).setLevel(level)
                logging.getLogger(name).removeHandler(LOG)


def write_keys(path: Path, count: int = KEYS) -> list[str]:
    """An --api-key-file of ``count`` named keys (``t000:sk-test-000`` ...), 0600; returns the keys."""
    keys = [f"sk-test-{i:03d}" for i in range(count)]
    path.write_text("".join(f"t{i:03d}:{k}\n" for i, k in enumerate(keys)))
    path.chmod(0o600)
    return keys


class LocalServer:
    """``--serve`` with every rank a thread of this process. ``args``: the runner's flags (the model, limits);
    ``folder``: its --serve-dir (``folder/state``) and key file (``keys``: how many, 0 for none)."""

    def __init__(self, args: list[str], folder: Path, stages: int = 1, keys: int = KEYS, name: str = "server"):
        self.args, self.folder, self.stages, self.name = list(args), Path(folder), stages, name
        self.folder.mkdir(parents=True, exist_ok=True)
        self.serve_dir = self.folder / "state"
        self.keys = write_keys(self.folder / "keys", keys) if keys else []
        self._next_key = itertools.count()
        self.port: int | None = None
        self.thread: threading.Thread | None = None
        self.stopping: threading.Event | None = None
        self.code: int | None = None
        self.error: BaseException | None = None
        self.log = LOG

    # -- life ---------------------------------------------------------------------------------
    def argv(self) -> list[str]:
        keys = ["--api-key-file", str(self.folder / "keys")] if self.keys else []
        return [*self.args, "--serve", f"127.0.0.1:{self.port}", "--in-process", "--pipeline-group-size",
                str(self.stages), "--serve-dir", str(self.serve_dir), "--num-threads", "1", "--no-progress", *keys]

    def start(self, seconds: float = START_SECONDS) -> "LocalServer":
        """Start it and wait until /health answers 200 (a port picked here: no gloo listener can take it)."""
        import torch

        assert self.thread is None or not self.thread.is_alive(), "already running"
        self.port, self.code, self.error = free_port(), None, None
        self.stopping = threading.Event()
        threads, others = torch.get_num_threads(), set(threading.enumerate())
        _enter_process()
        self.thread = threading.Thread(target=self._run, name=f"{self.name} rank 0", daemon=True)
        self.thread.start()
        try:
            self._wait_healthy(seconds)
        except BaseException:
            self.stop(check=False)
            raise
        finally:
            torch.set_num_threads(threads)  # the ranks set theirs (--num-threads 1)
        for t in set(threading.enumerate()) - others:  # its ranks' threads say whose they are: alive on purpose,
            if t.name.startswith("rank "):            # not a finished run's left behind
                t.name = f"{self.name} {t.name}"
        return self

    def _run(self) -> None:
        import dist_inference_runner

        try:
            self.code = dist_inference_runner.main(self.argv(), signals=False, stopping=self.stopping)
        except BaseException as e:  # noqa: BLE001 - start() and stop() report it
            self.error = e

    def _wait_healthy(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not self.thread.is_alive():
                raise AssertionError(f"the server stopped before it served: exit {self.code}, {self.error!r}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url("/health"), timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise AssertionError(f"the server did not answer /health within {seconds} s")

    def stop(self, seconds: float = 60, check: bool = True) -> int | None:
        """Stop it as SIGTERM would (finish what runs, stop every rank); its exit code."""
        if self.thread is None:
            return None
        self.stopping.set()
        self.thread.join(seconds)
        alive, self.thread = self.thread.is_alive(), None
        _leave_process()
        if check:
            assert not alive, f"the server did not stop within {seconds} s"
            assert self.error is None and self.code == 0, (self.code, self.error)
        return self.code

    def restart(self, args: list[str] | None = None) -> "LocalServer":
        """Stop, then start on the same --serve-dir (``args``: other flags), on another port."""
        self.stop()
        if args is not None:
            self.args = list(args)
        return self.start()

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    # -- talking to it ------------------------------------------------------------------------
    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def key(self) -> str:
        """A key no other test of this server has taken (its own Batch API namespace)."""
        i = next(self._next_key)
        assert i < len(self.keys), f"more than {len(self.keys)} keys taken: raise KEYS"
        return self.keys[i]

    def owner(self, key: str) -> str:
        """The name of ``key`` in the key file: its Batch API owner (tasks.batch_store.BatchStore's ``owner``)."""
        return f"t{self.keys.index(key):03d}"

    def client(self, key: str | None = None, **kw):
        """An ``openai.OpenAI`` client of this server (``key``: one of :meth:`key`; none for a keyless server)."""
        import openai

        return openai.OpenAI(base_url=self.url("/v1"), api_key=key or "none", max_retries=0, timeout=120, **kw)

    def pending(self) -> int:
        return httpx.get(self.url("/health"), timeout=10).json()["pending"]


# -- a server in processes of its own: only for what only processes show (signals, kills, limits) -----
KEY = "sk-test-process"  # a ProcessServer's --api-key (its Batch API owner: "default")


class ProcessServer:
    """The runner in serve mode as processes of its own: P > 1 in the seed's per-rank launch (one process a
    rank, ``--rank i --dist-url``; rank 0 serves); ``nofile``: the open-file limit of each."""

    def __init__(self, args: list[str], nproc: int, folder: Path, nofile: int | None = None):
        self.args, self.nproc, self.folder, self.nofile = list(args), nproc, folder, nofile
        self.log, self.base, self.procs = folder / "server.log", None, []
        self.serve_dir = folder / "state"

    def start(self) -> "ProcessServer":
        def limit() -> None:
            if self.nofile:
                resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

        args = [str(RUNNER), *self.args, "--serve", "0", "--serve-dir", str(self.folder / "state"), "--api-key", KEY,
                "--num-threads", "1", "--no-progress"]
        layout = ["--world-size", str(self.nproc), "--pipeline-group-size", str(self.nproc), "--dist-url",
                  f"tcp://127.0.0.1:{free_port()}"] if self.nproc > 1 else []
        since = self.log.stat().st_size if self.log.exists() else 0
        self.procs = []
        for rank in range(self.nproc):
            ranked = [*layout, "--rank", str(rank)] if layout else []
            with open(self.log if rank == 0 else self.folder / f"rank{rank}.log", "ab") as log:
                self.procs.append(subprocess.Popen([sys.executable, *args, *ranked], stdout=log, stderr=log,
                                                   env=_env(None), preexec_fn=limit, start_new_session=True))
        self.base = wait_served(self.procs[0], self.log, 240, since)  # a port of its own at every start
        return self

    @property
    def proc(self) -> subprocess.Popen:
        """Rank 0's process (the one that serves)."""
        return self.procs[0]

    def url(self, path: str = "") -> str:
        return self.base + path

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url("/v1"), api_key=KEY, max_retries=0, timeout=120)

    def kill(self) -> None:
        """SIGKILL: every rank at once (a crash)."""
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


# -- shared servers ------------------------------------------------------------------------------
def _default_model(make_llama) -> str:
    from pipeline.loading.default_model import default_model_dir

    return str(default_model_dir())


# name -> (the model, from the session's make_llama; the flags)
CONFIGS = {
    # the 2-layer tiny Llama (one layer a stage at P = 2): answers as file mode's, streaming, errors, limits, Batch
    # API, /metrics (the stages' figures every second)
    "tiny": (lambda make_llama: make_llama(num_hidden_layers=2),
             ["--served-model-name", "tiny", "--max-pending", "40", "--max-request-bytes", "200000",
              "--status-interval", "1"]),
    # the embedded default model with tight limits: bodies, uploads, headers, unread streams; the chat client,
    # the web page's HTTP side; at P = 2: structured outputs (a grammar compiled within 10 s)
    "default": (_default_model,
                ["--max-request-bytes", "65536", "--max-upload-bytes", "1000000", "--header-timeout", "1.5",
                 "--body-timeout", "1.5", "--send-timeout", "2", "--grammar-timeout", "10"]),
    # the default model with the default request limits: huge prompts, tokenizing off the pipeline, load
    "default-wide": (_default_model, ["--header-timeout", "1.5", "--send-timeout", "2", "--body-timeout", "1.5"]),
}


class Servers:
    """The session's shared servers: :meth:`get` starts one per (configuration, P) on first use."""

    def __init__(self, make_llama, tmp_path_factory):
        self.make_llama, self.tmp = make_llama, tmp_path_factory
        self.started: dict[tuple[str, int], LocalServer] = {}
        self.lock = threading.Lock()

    def get(self, config: str, stages: int = 1) -> LocalServer:
        with self.lock:
            if (config, stages) not in self.started:
                model, flags = CONFIGS[config]
                folder = self.tmp.mktemp(f"server-{config}-P{stages}")
                server = LocalServer(["--model-name", model(self.make_llama), *flags], folder, stages,
                                     name=f"{config} P{stages}")
                self.started[(config, stages)] = server.start()
            server = self.started[(config, stages)]
        assert server.running, f"the shared server {config} P{stages} stopped: a test stopped it?"
        return server

    def stop_all(self) -> None:
        for server in self.started.values():
            server.stop(check=False)


@pytest.fixture(scope="session")
def servers(make_llama, tmp_path_factory):
    """The shared in-process servers (:class:`Servers`); stopped at the end of the run."""
    s = Servers(make_llama, tmp_path_factory)
    yield s
    s.stop_all()
