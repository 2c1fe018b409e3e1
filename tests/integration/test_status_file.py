"""The live status file (--status-file) read while a two-stage run goes: it advances, its counts add
up, it ends ``finished``; after a SIGKILL of one rank it ends ``failed`` or goes stale."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.status import describe, is_stale, read_status
from tests.utils import RUNNER, _env, free_port, read_jsonl, write_jsonl

pytestmark = pytest.mark.multiprocess

N = 24


def requests(n: int = N, max_tokens: int = 24) -> list[dict]:
    return [{"prompt": f"Request {i}: the pipeline keeps every stage busy while", "max_tokens": max_tokens,
             "temperature": 0.0} for i in range(n)]


def launch(model: str, data: Path, status: Path, tmp: Path) -> list[subprocess.Popen]:
    """Two ranks by the legacy per-rank launch, so that each rank's process is ours to kill."""
    url = f"tcp://127.0.0.1:{free_port()}"
    args = ["--model-name", model, "--infer-data", str(data), "--status-file", str(status), "--status-interval", "1",
            "--max-micro-batch-size", "2", "--budget", "4096", "--no-progress", "--timeout", "60"]
    procs = []
    for r in range(2):
        log = open(tmp / f"rank{r}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(RUNNER), *args, "--rank", str(r), "--world-size", "2",
                                       "--pipeline-group-size", "2", "--dist-url", url], stdout=log, stderr=log,
                                      env=_env(None), start_new_session=True))
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def watch(status: Path, procs: list[subprocess.Popen], seconds: float) -> list[dict]:
    """The status file's successive contents until every process exited."""
    seen, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        s = read_status(status)
        if s is not None and (not seen or s["updated_at"] != seen[-1]["updated_at"]):
            seen.append(s)
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.1)
    final = read_status(status)
    if final is not None:
        seen.append(final)
    return seen


def test_status_advances_adds_up_and_finishes(llama_2l, tmp_path):
    data = write_jsonl(tmp_path / "req.jsonl", requests())
    status = tmp_path / "run.status.json"
    procs = launch(llama_2l, Path(data), status, tmp_path)
    try:
        seen = watch(status, procs, 300)
    finally:
        stop(procs)
    logs = "".join((tmp_path / f"rank{r}.log").read_text() for r in range(2))
    assert all(p.returncode == 0 for p in procs), logs[-3000:]
    print("\n".join(describe(s, s["updated_at"]) for s in seen))
    final = seen[-1]
    assert final["state"] == "finished", final
    assert final["lines_total"] == final["lines_done"] == N
    done = [s["lines_done"] for s in seen]
    assert done == sorted(done), done  # never goes back
    assert any(0 < d < N for d in done) or len({s["updated_at"] for s in seen}) >= 3, done  # it advanced
    assert seen[0]["state"] in ("loading", "running")
    assert not is_stale(final)
    out = read_jsonl(tmp_path / "output_req.jsonl")
    assert final["generated_tokens"] == sum(o["result"]["usage"]["completion_tokens"] for o in out)
    assert final["prompt_tokens"] == sum(o["result"]["usage"]["prompt_tokens"] for o in out)
    assert final["errors"] == 0 and final["files"][0]["state"] == "finished"
    assert final["run"]["model"] == str(Path(llama_2l).resolve())
    assert final["run"]["flags"]["status_interval"] == 1
    staged = [s for s in seen if s["stages"]]
    assert staged and all(len(s["stages"]) == 2 for s in staged)  # both stages' figures reached the writer
    assert all(0 <= st["busy_fraction"] <= 1 and st["peak_memory_mb"] > 0 for s in staged for st in s["stages"])
    assert final["eta_seconds"] == 0.0 and final["heartbeat_seconds"] == 1.0


@pytest.mark.parametrize("victim", [0, 1])
def test_status_after_sigkill_is_failed_or_stale(llama_2l, tmp_path, victim):
    """Rank 0 killed: the writer sees its peer gone and writes ``failed``. The writer killed: the file
    stops changing and reads as stale after a few heartbeats."""
    data = write_jsonl(tmp_path / "req.jsonl", requests(60, 48))
    status = tmp_path / "run.status.json"
    procs = launch(llama_2l, Path(data), status, tmp_path)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            s = read_status(status)
            if s is not None and s["state"] == "running" and s["lines_done"] > 0:
                break
            assert all(p.poll() is None for p in procs), "a rank ended before the kill"
            time.sleep(0.1)
        else:
            pytest.fail("the run never reported progress")
        os.kill(procs[victim].pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            s = read_status(status)
            if s["state"].startswith("failed") or is_stale(s):
                break
            time.sleep(0.5)
        print(describe(s))
        assert s["state"].startswith("failed") or is_stale(s), s
        assert s["lines_done"] < s["lines_total"]
        if victim == 0:  # the writer lives on long enough to say why
            assert s["state"].startswith("failed"), s
    finally:
        stop(procs)
