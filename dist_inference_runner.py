"""Pipeline-parallel batch inference over OpenAI-style completion request files.

    torchrun --nproc-per-node 8 dist_inference_runner.py --model-name MODEL_DIR --infer-data requests.jsonl

Each process holds a slice of the layers; rank 0 reads and schedules the requests, activations
flow down the pipeline (NCCL on GPU, gloo on CPU) and the last rank writes one OpenAI-format
result per request, in input order, to ``output_<input name>`` beside the input.
The seed's per-rank launch works too:
``python dist_inference_runner.py ... --rank i --world-size P --pipeline-group-size P --dist-url tcp://HOST:PORT``.
"""

from __future__ import annotations

import os
import signal

START_PPID = os.getppid()  # the launcher, read first thing: a rank must not outlive it (comm.lifeline)
if __name__ == "__main__":  # the runner's own process: SIGTERM and SIGINT blocked before any library (torch,
    # OpenMP, tokenizers) starts a thread, which would inherit them unblocked and take the default action (an
    # exit with no log line, a KeyboardInterrupt traceback); only watch_signals' thread receives them
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})

import functools  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:  # the project's packages, wherever the runner is started from
    sys.path.insert(0, str(ROOT))

from pipeline.config.openmp import passive_waits  # noqa: E402 (the standard library only)

OPENMP_WAITS = passive_waits()  # before torch loads its OpenMP runtime, which reads it once

from comm.dist import shutdown  # noqa: E402
from comm.lifeline import launcher_pid, watch_launcher as watch  # noqa: E402
from comm.p2p import PeerLost  # noqa: E402
from python_api import (LLM, Choice, CompletionOutput, EngineDead, GuidedDecodingParams, Logprob,  # noqa: E402,F401
                        RequestFailed, RequestOutput, Result, SamplingParams, Score,
                        StructuredOutputsParams)  # the Python API (vLLM's names too)
from pipeline.config.estimate import dry_run  # noqa: E402
from pipeline.config.options import UsageError, parse_options, quiet_exit_grace  # noqa: E402
from pipeline.config.plan import make_plan, output_for, resolve_dtype  # noqa: E402,F401 (resolve_dtype: re-exported)
from pipeline.runtime.in_process import in_process_options, plan_env, rank_of_thread, run_in_process  # noqa: E402
from pipeline.runtime.monitor import stop_metrics  # noqa: E402
from pipeline.runtime.roles import make_engine, serve_rank, start_rank  # noqa: E402
from pipeline.runtime.sources import FileList, RunError  # noqa: E402
from terminal.interactive import run_chat_client, run_interactive  # noqa: E402
from tasks.serve_dir import serve_dir_problem  # noqa: E402
from tasks.dummy import DummyWorkload, print_latency, write_dummy_requests  # noqa: E402
from tasks.inflight import recording, stop_all  # noqa: E402
from tasks.output_file import precision_note  # noqa: E402
from tasks.status import fail_active  # noqa: E402

log = logging.getLogger("runner")


class _RankPrefix(logging.Filter):
    """Each log line's rank: the process's, or with ``--in-process`` the rank whose thread logs it."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = rank_of_thread(self.rank)
        return True


def setup_logging(rank: int) -> None:
    level = os.environ.get("DIST_INFER_LOG", "INFO").upper()
    root = logging.getLogger()
    fresh = not root.handlers
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="[rank %(rank)s] %(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if fresh:
        for handler in root.handlers:
            handler.addFilter(_RankPrefix(rank))


def main(argv: list[str] | None = None, signals: bool = True, stopping: threading.Event | None = None) -> int:
    """Parse and plan (a flag that cannot work exits 2 here, before any process group or loading),
    then execute. A problem found before the ranks meet is the same on every rank: rank 0 prints it,
    the others exit with the same code quietly. ``signals=False`` leaves signal handling to an
    in-process caller (tests), who may stop the run with ``stopping``."""
    rank = launch_rank(sys.argv[1:] if argv is None else argv)
    opts = parse_options(argv, quiet=rank != 0)  # exits 2 with a message on bad flags
    setup_logging(rank)
    if opts.chat and opts.url:  # a client of a running server: nothing to load here
        return run_chat_client(opts)
    if opts.dry_run:  # the plan and an estimate; no process group, no weights, no outputs
        try:
            return dry_run(opts, sys.argv[1:] if argv is None else argv)
        except UsageError as e:
            return usage_error(e, quiet=rank != 0)
    if signals:
        watch_signals(rank, opts.serve is not None)
        watch_launcher()

    try:
        launch, opts, plan = plan_run(opts)
        # --serve-dir is trusted only when it is this user's and closed to others: refused before anything loads
        problem = serve_dir_problem(opts.serve_dir) if opts.serve is not None and opts.serve_dir is not None else None
        if problem:
            raise UsageError(problem)
    except UsageError as e:
        return usage_error(e, quiet=rank != 0)
    if rank == 0:
        log_plan(plan)
    if plan.nothing_to_do:  # every output is complete and this run's: start nothing, load nothing
        if rank == 0:
            for path in plan.all_inputs:
                output = output_for(path, opts.output_path, len(plan.all_inputs) > 1)
                print(f"{path}: skipped, output already complete at {output} (--overwrite recomputes)",
                      file=sys.stderr)
        return 0
    try:
        return start(launch, opts, plan, stopping)
    except UsageError as e:
        return usage_error(e)
    except Exception as e:  # noqa: BLE001 - one clear line per failing rank, then exit without hanging
        if isinstance(e, (PeerLost, RunError)):
            log.error("rank %d stops: %s", rank, e)
        elif type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError (CUDA)
            log.error("rank %d stops: %s", rank, out_of_memory_advice(opts))
        else:
            log.exception("rank %d failed: %s", rank, e)
        log.error("rank %d: finished results are journaled; rerun the same command to resume", rank)
        if not signals:  # an in-process caller: its process goes on
            return 1
        _hard_exit(1)


def out_of_memory_advice(opts) -> str:
    """What to lower when a stage runs out of GPU memory during the run."""
    return (f"out of GPU memory: the KV cache and one pass's activations did not fit; lower --budget (this run: "
            f"{opts.budget} tokens) or --max-micro-batch-size ({opts.max_micro_batch_size}), or spread the layers over "
            "more stages (--pipeline-group-size)")


def launch_rank(argv: list[str]) -> int:
    """This process's rank before the flags are checked: ``--rank N`` (the seed's launch), else torchrun's RANK."""
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--rank=") else argv[i + 1] if arg == "--rank" and i + 1 < len(argv) else None
        if value is not None:
            return int(value) if value.isdigit() else 0
    value = os.environ.get("RANK", "0")
    return int(value) if value.isdigit() else 0


def usage_error(e: UsageError, quiet: bool = False) -> int:
    """Exit code 2; the message on stderr and, under torchrun, in the agent's error file."""
    if quiet:
        quiet_exit_grace()
        return 2
    message = f"dist_inference_runner.py: error: {e}"
    print(message, file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # torchrun shows it in its failure report
    if error_file:
        import json

        try:
            Path(error_file).write_text(json.dumps({"message": {"message": f"UsageError: {e}", "extraInfo": {
                "py_callstack": message, "timestamp": str(int(time.time()))}}}))
        except OSError:
            pass
    return 2


def _hard_exit(code: int) -> None:
    """Exit now: a process group whose peer died can hang in its destructor."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


STOP_GRACE = 0.5  # seconds the last stage waits, after a signal, to tell a stop from a dead peer (P > 1)
BACKSTOP_S = 25.0  # seconds after a signal by which any rank still alive exits anyway
RECEIVED: list[int] = []  # the stopping signal, once received (the run exits 128 + it after draining)
STOP = threading.Event()  # set by SIGTERM/SIGINT: rank 0's engine stops admitting, drains and stops every rank


def stopped_code() -> int:
    """The exit code of a run a signal stopped: 128 + the signal (143 for SIGTERM, 130 for SIGINT); else 0."""
    return 128 + RECEIVED[0] if RECEIVED else 0


def _backstop(sig: int) -> None:
    """A rank still alive :data:`BACKSTOP_S` seconds after the signal: its status file says so, then it exits."""
    fail_active(f"{signal.Signals(sig).name} received; not stopped within {BACKSTOP_S:g} s")
    _hard_exit(128 + sig)


def watch_signals(rank: int, serving: bool = False) -> None:
    """SIGTERM (preemption) and SIGINT stop every rank promptly, even inside a blocking receive: one
    path for every launch style and face. Python runs signal handlers only between bytecodes, never
    while the main thread waits in a gloo/NCCL call, so the signals are blocked in every thread and a
    dedicated thread waits for them and sets :data:`STOP` (rank 0's engine drains and sends Stop down
    the pipeline; every rank exits 128 + the signal, or at :data:`BACKSTOP_S` seconds anyway)."""
    sigs = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)

    def wait() -> None:
        sig = signal.sigwait(sigs)
        name = signal.Signals(sig).name
        RECEIVED.append(sig)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and recording():
            # the last stage: when an earlier stage dies, torchrun sends this signal to the others; the
            # connection to the dead stage is seen lost meanwhile (the main thread exits 1 and the run
            # counts as a crash, not a stop: tasks.inflight)
            time.sleep(STOP_GRACE)
        stop_all()  # the lines in flight did not end this run (tasks.inflight)
        log.warning("rank %d: %s received, %s", rank, name, "finishing in-flight requests and stopping" if serving
                    else "finishing the rows in flight and stopping; finished results are journaled, rerun the "
                    "same command to resume")
        STOP.set()  # the status file says stopped once the last rank has the Stop (a crash meanwhile: failed)
        backstop = threading.Timer(BACKSTOP_S, _backstop, (sig,))
        backstop.daemon = True
        backstop.start()

    threading.Thread(target=wait, name="signals", daemon=True).start()


def watch_launcher() -> None:
    """A rank started by torchrun or launch/legacy_per_rank.sh exits (SIGTERM's way) when that launcher
    is gone, even after ``kill -9`` of it (comm.lifeline)."""
    expected = launcher_pid(os.environ, START_PPID)
    if expected is not None:
        watch(expected)


def run(opts) -> int:
    """Plan (every flag checked, nothing loaded), then execute on this rank, or with ``--in-process`` every
    rank (in-process use, tests: errors are raised, signals left to the caller)."""
    launch, opts, plan = plan_run(opts)
    log_plan(plan)
    return 0 if plan.nothing_to_do else start(launch, opts, plan)


def log_plan(plan) -> None:
    for warning in plan.warnings:
        log.warning("%s", warning)
    if plan.layout_note:
        log.info("%s", plan.layout_note)


def plan_run(opts):
    """(the run's options, this rank's options, this rank's plan). With ``--in-process`` this is rank 0,
    planned apart from any launcher's environment."""
    if not opts.in_process:
        return opts, opts, make_plan(opts)
    rank0 = in_process_options(opts)
    return opts, rank0, make_plan(rank0, plan_env())


def start(launch, opts, plan, stopping: threading.Event | None = None) -> int:
    """This rank's start-up and role; with ``--in-process`` every rank's, on threads of this process."""
    if launch.in_process:
        return run_in_process(launch, plan, functools.partial(execute, stopping=stopping), make_plan)
    return execute(plan, opts, stopping=stopping)


def execute(plan, opts, info=None, stopping: threading.Event | None = None) -> int:
    """Start this rank (``info``: its place when every rank runs in this process), play its role: rank
    0 runs the face the flags name (request files, the server, the terminal) on its engine, the others
    serve passes until Stop. ``stopping``: what stops the engine (default :data:`STOP`, the signals').
    Returns the exit code."""
    rank = start_rank(plan, opts, info)
    last_output, clean = None, False
    try:
        if not rank.info.is_first:
            last_output = serve_rank(rank)
            clean = True
            return stopped_code()
        stopping = stopping or STOP
        if opts.prompts or opts.prompts_file or opts.chat:
            code = run_interactive(rank, stopping)
        elif opts.serve is not None:
            from serve.server import run_server  # lazy: FastAPI and uvicorn, 0.6 s of every other rank's start-up

            run_server(rank, stopping)
            code = stopped_code()
        else:
            last_output, code = run_files(rank, stopping)
        clean = True
        return code
    except BaseException as e:
        fail_active(f"{type(e).__name__}: {e}")
        raise
    finally:
        if rank.stage.trace is not None and last_output:
            log.info("profile trace: %s", rank.stage.trace.save(f"{last_output}.trace-rank{rank.info.rank}.json"))
        stop_metrics(rank.metrics)
        shutdown(rank.info, clean)


def run_files(rank, stopping: threading.Event) -> tuple[str | None, int]:
    """File mode on rank 0: every input through the engine, one after the other (dummy-data mode:
    generated requests, a latency report); (the last output, the exit code)."""
    plan, opts = rank.plan, rank.opts
    inputs, dummy = list(plan.inputs), None
    workload = DummyWorkload(opts.batch_size, opts.input_seq_length, opts.generate_seq_length)
    if not inputs:
        dummy = write_dummy_requests(workload)
        inputs = [dummy]
    files = FileList([(i, output_for(i, opts.output_path, len(inputs) > 1)) for i in inputs])
    make_engine(rank, files=files, stopping=stopping).run()
    if stopping.is_set():
        return files.last_output, stopped_code() or 143
    reports = files.reports
    summarize(reports)
    if dummy:
        print_latency(reports[0], workload)
        for path in (dummy, reports[0].output, reports[0].output + ".summary.json"):
            Path(path).unlink(missing_ok=True)
    # errors, and choices a reasoning model left without an answer (the summary's reasoning.starved)
    failed = sum(r.errors + (r.summary.reasoning.get("starved", 0) if r.summary is not None else 0) for r in reports)
    return files.last_output, 1 if (opts.strict and failed) else 0


def summarize(reports) -> None:
    for r in reports:
        if r.skipped:
            print(f"{r.input}: skipped, output already complete at {r.output}", file=sys.stderr)
            continue
        rate = r.generated_tokens / r.seconds if r.seconds else 0.0
        share = r.summary.data_group_size
        part = f" (data group {r.summary.data_rank} of {share}: its share of the lines)" if share > 1 else ""
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(r.error_kinds.items())) or "none"
        ignored = r.summary.ignored_fields
        if ignored:  # --lenient-fields
            kinds += "; ignored fields: " + ", ".join(f"{k}: {v}" for k, v in sorted(ignored.items()))
        note = precision_note(r.summary.stage_precision)
        precision = f" [{note}]" if note else ""
        first, started = r.summary.first_result_seconds, r.summary.startup_seconds
        ttft = f"; first result {started + first:.1f}s after the process started" if first is not None \
            and started is not None else ""
        print(f"{r.input}: {r.requests} requests, {r.requests - r.errors} answered, {r.errors} errors ({kinds}); "
              f"{r.prompt_tokens} prompt + {r.generated_tokens} generated tokens in {r.seconds:.1f}s "
              f"({rate:.1f} tok/s) -> {r.output}{part}{precision}{ttft}", file=sys.stderr)
        thinking = r.summary.reasoning
        if thinking:
            print(reasoning_line(r.input, thinking), file=sys.stderr)


def reasoning_line(name: str, f: dict) -> str:
    """A file's reasoning figures in one line; starved answers said loudly, with what to do."""
    line = (f"{name}: {f['thinking_rows']} rows thought ({f['reasoning_tokens']} reasoning tokens, "
            f"{f['forced_ends']} ended by their thinking budget)")
    if f.get("retried"):
        line += f"; --retry-starved ran {f['retried']} request(s) again, {f['repaired']} of them answered"
    if f.get("starved"):
        line += (f"; WARNING: {f['starved']} choice(s) with no answer: the thinking used max_tokens (finish_reason "
                 "length, \"starved\" in the choice); raise max_tokens, set thinking_token_budget or reasoning_effort, "
                 "or run with --retry-starved; --strict makes this exit 1")
    return line


if __name__ == "__main__":
    sys.exit(main())
