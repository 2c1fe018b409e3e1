"""Reliability as only real processes show it: kill -9 at every fault point (the whole job, one rank of
two) and a rerun that ends with a clean run's file; a dying peer heard within seconds on the header
channel, and the status file of a killed run (failed, or stale when the writer died); a rank killed
while loading stops every rank; a line that kills its process answered with an error on the third run
(no crash loop), also when an earlier stage dies on its first pass; SIGINT and SIGTERM through the
seed's launch script; a refused output reported once under torchrun; a second run on an output
another process is writing refused.

The killed runs are processes (the fault points SIGKILL their own process: comm.faults); the reruns
and the clean references run in this process (``--in-process``, tests.utils.run_local: the same rank
loops), which is what resuming needs of them. File mode's other guarantees: tests/runs/test_reliability_runs.py
and tests/runs/test_failure_isolation_runs.py."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks import writer
from tasks.inflight import replay
from tasks.status import is_stale, read_status
from tests.unit.pipeline.cache.test_prefix import assert_same_answers, model_dir, reference, workload  # noqa: F401
from tests.unit.tasks.test_writer import FP as WRITER_FP, line, lines_of
from tests.utils import (REPO, RUNNER, _close, _env, _kill_group, assert_consistent_results, assert_identical_results,
                         free_port, read_jsonl,
                         run_local, run_single, run_torchrun, strip_volatile, write_jsonl)

DEFAULT_MODEL = str(REPO / "examples" / "tiny-llama-default")
EXACT = ["--budget", "400", "--batch-invariant"]  # a resumed run's micro-batches differ from the clean run's


@pytest.fixture(scope="module")
def llama_3l(make_llama):
    return make_llama(num_hidden_layers=3, max_position_embeddings=256)


@pytest.fixture(scope="module")
def work_file(tmp_path_factory):
    """Enough requests that a run spans many passes."""
    path = tmp_path_factory.mktemp("work") / "work.jsonl"
    lines = [{"prompt": f"Request number {i}: the garden is", "max_tokens": 6 + i % 5, "temperature": 0.7,
              "logprobs": 1} for i in range(40)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def clean_output(llama_3l, work_file, tmp_path_factory):
    """The work file's answers, uninterrupted (--batch-invariant: the same at every P)."""
    out = tmp_path_factory.mktemp("clean") / "clean.jsonl"
    p = run_local(["--model-name", llama_3l, "--infer-data", str(work_file), "--output-path", str(out), *EXACT], 2)
    assert p.returncode == 0, p.stderr[-3000:]
    return read_jsonl(out)


def legacy(args: list[str], nproc: int, env: dict | None = None) -> list[subprocess.Popen]:
    """The seed's per-rank launch: one process per rank, each ours to watch (and to kill)."""
    url = f"tcp://127.0.0.1:{free_port()}"
    return [subprocess.Popen([sys.executable, str(RUNNER), *args, "--rank", str(i), "--world-size", str(nproc),
                              "--dist-url", url, "--num-threads", "1"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env(env), start_new_session=True)
            for i in range(nproc)]


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    """Each process's stderr once it exited (killed after ``timeout``)."""
    try:
        return [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            _kill_group(p)


def wait_for(check, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# -- kill -9 and resume ---------------------------------------------------------------------------

def test_kill_9_at_each_fault_point_then_the_rerun_equals_a_clean_run(llama_3l, work_file, clean_output, model_dir,
                                                                       workload, reference, tmp_path):  # noqa: F811
    """The whole job killed before anything is written (prefill), with every line journaled but the
    output not yet published (finalize), with 3 lines journaled on a workload sharing prefixes (midgen:
    the rerun's answers equal the prefix cache off); one rank of two killed: the last (midgen: rank 0
    hears of it within seconds on the header channel, the status file goes stale) or the first (drive:
    the writing rank says ``failed`` in the status file). No output appears until it is complete, and
    the same command run again ends with the clean run's file."""
    for stages, point, rank in [(1, "prefill", 0), (1, "finalize", 0), (2, "midgen", 1), (2, "drive", 0)]:
        out = tmp_path / f"{point}-{stages}.jsonl"
        status = tmp_path / f"{point}-{stages}.status.json"
        args = ["--model-name", llama_3l, "--infer-data", str(work_file), "--output-path", str(out), *EXACT,
                "--status-file", str(status), "--status-interval", "1"]
        fault = {"DIST_INFER_FAULT": point, "DIST_INFER_FAULT_RANK": str(rank)}
        if stages == 1:
            p = run_single(args, env=fault)
            assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
        else:
            procs = legacy(args, 2, env=fault)
            procs[rank].wait(timeout=240)  # killed by the fault point
            t0 = time.monotonic()
            errs = finish(procs, timeout=60)
            assert procs[rank].returncode == -signal.SIGKILL and procs[1 - rank].returncode not in (0, None)
            assert time.monotonic() - t0 < 30, "the other rank should stop within seconds"
            if rank == 1:  # rank 0 waits for the last rank's reply on the header channel (gloo)
                assert "lost contact with rank 1 on the header channel" in errs[0], errs[0][-2000:]
                wait_for(lambda: is_stale(read_status(status)), 30, "the dead writer's status file did not go stale")
            else:  # the writer lives on long enough to say why
                assert read_status(status)["state"].startswith("failed"), read_status(status)
            s = read_status(status)
            assert s["lines_done"] < s["lines_total"]
        assert not out.exists(), "the output must appear only complete"
        if point in ("midgen", "finalize"):
            assert Path(f"{out}.partial").exists()
        p = run_local(args, stages)
        assert p.returncode == 0, p.stderr[-3000:]
        if point == "midgen":
            assert "resuming after" in p.stderr
        assert_identical_results(read_jsonl(out), clean_output)
        assert not Path(f"{out}.partial").exists()
    # the prefix cache (tests/unit/pipeline/cache/test_prefix.py's workload): killed with 3 lines journaled
    out = tmp_path / "cache.jsonl"
    args = ["--model-name", model_dir, "--infer-data", workload, "--output-path", str(out), "--budget", "900"]
    assert run_single(args, env={"DIST_INFER_FAULT": "midgen", "DIST_INFER_FAULT_RANK": "0"}).returncode != 0
    p = run_local(args)
    assert p.returncode == 0 and "resuming after" in p.stderr, p.stderr[-3000:]
    assert_same_answers(read_jsonl(out), reference)


def test_a_rank_killed_while_loading_stops_every_rank_quickly(llama_3l, work_file, clean_output, tmp_path):
    """Rank 1 of 3 dies while loading (the seed's per-rank launch): the others hear of it in the barrier
    where every stage has loaded before --budget auto measures the memory left (pipeline.config.budget),
    or on a link, and exit within a minute; the same command then completes."""
    out = tmp_path / "out.jsonl"
    args = ["--model-name", llama_3l, "--infer-data", str(work_file), "--output-path", str(out), *EXACT]
    procs = legacy(args, 3, env={"DIST_INFER_FAULT": "load", "DIST_INFER_FAULT_RANK": "1"})
    t0 = time.monotonic()
    errs = finish(procs, timeout=60)
    assert time.monotonic() - t0 < 60
    codes = [p.returncode for p in procs]
    assert codes[1] == -signal.SIGKILL and codes[0] != 0 and codes[2] != 0
    said = errs[0] + errs[2]
    assert "lost contact with rank 1" in said or "lost contact with another rank while the stages agreed" in said
    assert not out.exists()
    p = run_local(args, 3)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_identical_results(read_jsonl(out), clean_output)


# -- a line that kills its process: no crash loop ---------------------------------------------------

def test_a_line_that_kills_its_process_is_cornered_and_answered_with_an_error(tmp_path):
    """The line kills its process each time it runs. Run 1 dies with it among the lines in flight; each
    following run probes the suspects in halves beside the rest of the file (pipeline/scheduling/isolation.py)
    and dies only while the half holding it runs, until the line dies alone; the run after answers it
    with an error and every other line as a clean run does (an innocent neighbour is never marked
    failed), within 1 + log2(lines in flight) deaths: no crash loop. At P = 1 the last rank dies as the
    pass admits the line (``line``); at P = 2 the first stage dies computing the line's first pass
    (``forward-kill``, a segfault on that request): rank 0 tells the last rank which lines a pass admits
    before any stage computes it (messages.Admitting), so the record holds the line although the last
    stage never saw its pass. The answering run runs in this process, without the fault (which would
    end the test's process): it must not run the line at all."""
    reqs = [{"prompt": f"Request {i}: the garden is", "max_tokens": 2 + i % 3, "temperature": 0.7, "seed": i}
            for i in range(24)]
    reqs[3].update(best_of=2, n=1, logprobs=2)
    reqs[9].update(n=2, temperature=0.9)
    reqs[11].update(echo=True, logprobs=1, max_tokens=0)
    src = write_jsonl(tmp_path / "w.jsonl", reqs)
    flags = ["--model-name", DEFAULT_MODEL, "--infer-data", src, "--no-progress", "--batch-invariant",
             "--max-micro-batch-size", "4"]
    clean = tmp_path / "clean.jsonl"
    p = run_local([*flags, "--output-path", str(clean)])
    assert p.returncode == 0, p.stderr[-3000:]
    ref = read_jsonl(clean)
    culprit = 13
    for stages, fault in [(1, {"DIST_INFER_FAULT": "line", "DIST_INFER_FAULT_RANK": "0"}),
                          (2, {"DIST_INFER_FAULT": "forward-kill", "DIST_INFER_FAULT_RANK": "0"})]:
        out = tmp_path / f"out-{stages}.jsonl"
        record = Path(f"{out}.partial.inflight")
        args = [*flags, "--output-path", str(out)]
        fault = dict(fault, DIST_INFER_FAULT_LINE=str(culprit))
        deaths, culprits = 0, set()
        while culprit not in culprits:  # until the record blames the line alone
            p = run_single(args, env=fault) if stages == 1 else run_torchrun(args, 2, env=fault)
            assert p.returncode != 0 and not out.exists(), p.stderr[-2000:]
            deaths += 1
            assert str(culprit) in record.read_text()
            assert deaths <= 1 + math.ceil(math.log2(len(reqs))), f"a crash loop: {deaths} deaths"
            if deaths > 1:
                assert "an earlier run ended while computing lines" in p.stderr, p.stderr[-2000:]
            journal = Path(f"{out}.partial")
            _, culprits = replay(record, journal.read_bytes().count(b"\n") if journal.exists() else 0)
        assert deaths >= 2  # it died in a batch first, then alone
        p = run_local(args, stages)
        assert p.returncode == 0, p.stderr[-3000:]
        got = read_jsonl(out)
        assert [i for i, x in enumerate(got) if "error" in x] == [culprit]
        assert "when the process ended" in got[culprit]["error"]["message"]
        assert not record.exists()
        keep = [i for i in range(len(reqs)) if i != culprit]
        assert_identical_results([got[i] for i in keep], [ref[i] for i in keep])


# -- two runs on one output ----------------------------------------------------------------------

def test_a_second_run_on_the_same_output_is_refused_while_the_first_writes(tmp_path):
    """Two runs on one output at once (a shard resubmitted while it runs, two drain loops on one folder) wrote
    every line twice; the journal's lock refuses the second (only another process shows it: a POSIX lock never
    blocks its own), and --overwrite must not clear the running one's journal."""
    out = tmp_path / "out.jsonl"
    first = writer.OrderedWriter(out, WRITER_FP)
    first.open()
    first.put(0, line(0))
    first.flush()
    hold = ("import sys; from tasks import writer as w; wr = w.OrderedWriter(sys.argv[1], %r); wr.open(); "
            "print('open', flush=True); sys.stdin.read()" % WRITER_FP)
    first._file.close()  # the first run goes on in another process
    other = subprocess.Popen([sys.executable, "-c", hold, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             cwd=REPO)
    try:
        assert other.stdout.readline() == b"open\n"
        for overwrite in (False, True):
            with pytest.raises(writer.JournalMismatch, match="being written by another run"):
                writer.OrderedWriter(out, WRITER_FP).open(overwrite)
        assert lines_of(first.journal) == [0]
    finally:
        other.communicate(b"")
    assert writer.OrderedWriter(out, WRITER_FP).open() == 1  # that run gone: this one resumes


# -- signals ----------------------------------------------------------------------------------------

def alive(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_sigint_and_sigterm_stop_every_rank_and_the_rerun_completes(llama_3l, tmp_path):
    """launch/legacy_per_rank.sh (two ranks) stopped twice mid-run: Ctrl-C (SIGINT to the foreground
    process group), then, started again (it resumes), a SIGTERM to the script alone (a scheduler
    stopping the job; its trap stops the ranks). Each time every rank stops within seconds, taking
    SIGTERM's way out (finished lines journaled, nothing published), and the script exits 128 + the
    signal (130, 143). The same command then completes with a clean run's file (up to the rounding of
the rows resumed mid-generation)."""
    marker = f"signals_{os.getpid()}_{time.monotonic_ns()}"
    data = write_jsonl(tmp_path / f"{marker}.jsonl", [{"prompt": f"Once upon a time {i}", "max_tokens": 40,
                                                       "temperature": 0.8, "seed": i} for i in range(64)])
    out = tmp_path / "out.jsonl"
    journal = Path(f"{out}.partial")
    flags = ["--num-threads", "1", "--no-progress", *EXACT]
    env = {**os.environ, "MODEL": llama_3l, "DATA": data, "NPROC": "2", "OUTPUT": str(out),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    journaled = 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        log = tmp_path / f"{sig.name}.log"
        with open(log, "w") as log_f:
            proc = subprocess.Popen(["bash", str(REPO / "launch" / "legacy_per_rank.sh"), *flags],
                                    env={**env, "PORT": str(free_port())}, stdout=log_f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            wait_for(lambda: proc.poll() is not None or (journal.exists() and journal.stat().st_size > journaled),
                     180, log.read_text()[-3000:])
            assert proc.poll() is None and len(alive(marker)) == 2, log.read_text()[-3000:]  # both ranks run
            t0 = time.monotonic()
            if sig == signal.SIGINT:
                os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground process group
            else:
                proc.send_signal(signal.SIGTERM)  # the script alone
            assert proc.wait(timeout=15) == 128 + sig, log.read_text()[-3000:]
            wait_for(lambda: not alive(marker), 10, "ranks survived the signal")
            assert time.monotonic() - t0 < 10
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        text = log.read_text()
        assert f"{sig.name} received" in text or "SIGTERM received" in text, text[-3000:]
        assert not out.exists()  # interrupted: no (incomplete) output published
        journaled = journal.stat().st_size
        assert journaled > 0
    p = run_local(["--model-name", llama_3l, "--infer-data", data, "--output-path", str(out), *flags], 2)
    assert p.returncode == 0 and "resuming after" in p.stderr, p.stderr[-3000:]
    clean = tmp_path / "clean.jsonl"
    p = run_local(["--model-name", llama_3l, "--infer-data", data, "--output-path", str(clean), *flags])
    assert p.returncode == 0, p.stderr[-3000:]
    # rows stopped mid-generation resume where they stopped (their prompt and tokens so far computed as a
    # prompt): the same tokens and texts, logprobs within 1e-4 (prefill against decode shapes)
    got, ref = read_jsonl(out), read_jsonl(clean)
    assert len(got) == len(ref)
    for i, (x, y) in enumerate(zip(got, ref, strict=True)):
        _close(strip_volatile(x), strip_volatile(y), 1e-4, f"line {i}")


def test_sigterm_checkpoints_rows_in_flight_under_python_and_torchrun(llama_3l, tmp_path):
    """SIGTERM to a plain ``python dist_inference_runner.py`` run (P = 1: its signals are blocked in
    every thread but the one that takes them) and then to torchrun (P = 2: it passes the signal to its
    ranks), each mid-generation: the process exits 143 within seconds with no traceback, the status
    file says stopped, the finished lines are journaled and the rows in flight checkpointed
    (``.partial.rows``); the rerun resumes them and ends as an uninterrupted run's file."""
    data = write_jsonl(tmp_path / "long.jsonl", [{"prompt": f"Once upon a time {i}", "max_tokens": 120,
                                                  "temperature": 0 if i % 2 else 0.8, "seed": i} for i in range(48)])
    out = tmp_path / "out.jsonl"
    journal, rows = Path(f"{out}.partial"), Path(f"{out}.partial.rows")
    common = ["--model-name", llama_3l, "--infer-data", data, "--no-progress", "--max-micro-batch-size", "4",
              "--checkpoint-interval", "0"]
    flags = [*common, "--output-path", str(out)]
    launches = {"python": [sys.executable, str(RUNNER), *flags, "--num-threads", "1"],
                "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                             "127.0.0.1", "--master-port", str(free_port()), str(RUNNER), *flags,
                             "--num-threads", "1"]}
    journaled = 0
    for name, cmd in launches.items():
        log = tmp_path / f"{name}.log"
        with open(log, "w") as log_f:
            proc = subprocess.Popen(cmd, env=_env({"OMP_NUM_THREADS": "1"}), stdout=log_f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            wait_for(lambda: proc.poll() is not None or (journal.exists() and journal.stat().st_size > journaled),
                     180, log.read_text()[-3000:])
            assert proc.poll() is None, log.read_text()[-3000:]
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=30)
            assert time.monotonic() - t0 < 25
        finally:
            _kill_group(proc)
        text = log.read_text()
        assert "SIGTERM received" in text, text[-3000:]
        if name == "python":  # torchrun reports a signalled agent in its own way
            assert code == 128 + signal.SIGTERM and "Traceback" not in text, (code, text[-3000:])
        assert not out.exists() and read_status(f"{out}.status.json")["state"] == "stopped", text[-3000:]
        assert rows.exists() and json.loads(rows.read_text()), f"{name}: no rows checkpointed"
        journaled = journal.stat().st_size
    p = run_local(flags, 2)
    assert p.returncode == 0 and "rows where they stopped" in p.stderr, p.stderr[-3000:]
    clean = tmp_path / "clean.jsonl"
    p = run_local([*common, "--output-path", str(clean)])
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(read_jsonl(out)) == 48
    assert_consistent_results(read_jsonl(clean), read_jsonl(out), tol=1e-3)


# -- torchrun's view of a refusal --------------------------------------------------------------------

def test_a_refused_output_under_torchrun_is_reported_once(llama_3l, tmp_path):
    """What a user sees for a flag problem under torchrun: the message once (rank 0), before the ranks
    meet (torchrun's own failure report may quote it again, in its own format); the shell sees
    torchrun's 1."""
    src = tmp_path / "r.jsonl"
    src.write_text('{"prompt": "x", "max_tokens": 1}\n')
    p = run_local(["--model-name", llama_3l, "--infer-data", str(src)])
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_torchrun(["--model-name", llama_3l, "--infer-data", str(src), "--seed", "7"], 2)
    message = "error: " + str(tmp_path / "output_r.jsonl") + " is complete but was written by another run"
    assert p.returncode == 1, p.stderr[-3000:]
    assert [line.startswith("dist_inference_runner.py: " + message) for line in p.stderr.splitlines()].count(True) == 1
    assert "process group up" not in p.stderr
    p = run_torchrun(["--model-name", llama_3l, "--infer-data", str(src), "--budget", "0"], 2)
    own = [line for line in p.stderr.splitlines() if line.startswith("dist_inference_runner.py: ")]
    assert p.returncode == 1 and len(own) == 1 and "--budget must be a positive number" in own[0], p.stderr[-3000:]
