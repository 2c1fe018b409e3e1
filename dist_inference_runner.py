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

START_PPID = os.getppid()  # the launcher, read first thing: a rank must not outlive it (comm.lifeline)

import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:  # the project's packages, wherever the runner is started from
    sys.path.insert(0, str(ROOT))

from pipeline.config.openmp import passive_waits  # noqa: E402 (the standard library only)

OPENMP_WAITS = passive_waits()  # before torch loads its OpenMP runtime, which reads it once

from comm.dist import init_distributed, shutdown  # noqa: E402
from comm.faults import LOAD, set_rank  # noqa: E402
from comm.lifeline import launcher_pid, watch_launcher as watch  # noqa: E402
from comm.p2p import PeerLost  # noqa: E402
from pipeline.api import LLM, Choice, EngineDead, RequestFailed, Result, SamplingParams, Score  # noqa: E402,F401 (the Python API)
from pipeline.config.options import UsageError, parse_options, quiet_exit_grace  # noqa: E402
from pipeline.config.plan import make_plan, output_for, resolve_dtype as resolve  # noqa: E402
from pipeline.runtime.first_rank import Job, RunError  # noqa: E402
from pipeline.runtime.host_memory import keep_freed_memory  # noqa: E402
from pipeline.config.estimate import dry_run  # noqa: E402
from pipeline.runtime.monitor import start_metrics, start_status  # noqa: E402
from pipeline.runtime.roles import first_rank, load_stage, load_tokenizer, run_budget, serve_rank  # noqa: E402
from serve.interactive import run_chat_client, run_interactive  # noqa: E402
from serve.source import STOPPING  # noqa: E402
from serve.state_dir import serve_dir_problem  # noqa: E402
from tasks.dummy import DummyWorkload, print_latency, write_dummy_requests  # noqa: E402
from tasks.inflight import recording, stop_all  # noqa: E402
from tasks.output_file import precision_note  # noqa: E402
from tasks.status import fail_active  # noqa: E402

if TYPE_CHECKING:
    import torch

log = logging.getLogger("runner")


def resolve_dtype(name: str, cfg: dict, device, model_dir: str | None = None) -> "torch.dtype":
    """The run's dtype (pipeline.config.plan.resolve_dtype, kept here for callers of the runner module)."""

    return resolve(name, cfg, device, model_dir)


def setup_logging(rank: int) -> None:
    level = os.environ.get("DIST_INFER_LOG", "INFO").upper()
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"[rank {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def main(argv: list[str] | None = None, signals: bool = True) -> int:
    """Parse and plan (a flag that cannot work exits 2 here, before any process group or loading),
    then execute.

    A problem found before the ranks meet is the same on every rank: rank 0 prints it (and, under
    torchrun, leaves it in the agent's error file so its failure report shows it), the other ranks
    exit with the same code quietly. ``signals=False`` leaves signal handling to an in-process
    caller (tests); otherwise SIGTERM and SIGINT are masked before anything (torch's import
    included) can start a thread.
    """

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
        watch_signals(rank, serving=opts.serve is not None)
        watch_launcher()

    try:
        plan = make_plan(opts)
        check_serve_dir(opts)
    except UsageError as e:
        return usage_error(e, quiet=rank != 0)
    if rank == 0:
        for warning in plan.warnings:
            log.warning("%s", warning)
        if plan.layout_note:
            log.info("%s", plan.layout_note)
    if plan.nothing_to_do:  # every output is complete and this run's: start nothing, load nothing
        if rank == 0:

            for path in plan.all_inputs:
                output = output_for(path, opts.output_path, len(plan.all_inputs) > 1)
                print(f"{path}: skipped, output already complete at {output} (--overwrite recomputes)",
                      file=sys.stderr)
        return 0
    try:
        return execute(plan, opts)
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
        _hard_exit(1)


def check_serve_dir(opts) -> None:
    """--serve-dir is trusted only when it is this user's and closed to others (serve.state_dir): refused
    before anything loads."""
    if opts.serve is None or opts.serve_dir is None:
        return

    problem = serve_dir_problem(opts.serve_dir)
    if problem:
        raise UsageError(problem)


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
RECEIVED: list[int] = []  # the stopping signal, once received (serve mode exits 128 + it after draining)


def stopped_code() -> int:
    """Serve mode's exit code: 128 + the signal that stopped it (143 for SIGTERM), as file mode's."""
    return 128 + RECEIVED[0] if RECEIVED else 0


def watch_signals(rank: int, serving: bool = False) -> None:
    """SIGTERM (preemption) and SIGINT stop every rank promptly, even inside a blocking receive.

    Python runs signal handlers only between bytecodes, never while the main thread waits in a
    gloo/NCCL call, so the signals are blocked in every thread and a dedicated thread waits for them.
    The journal is flushed after every write, so what finished is kept.

    Serving, rank 0 instead stops accepting requests, lets in-flight ones finish and stops every rank
    (serve.engine); any rank still alive 25 s after the signal exits anyway.
    """
    import signal
    import threading

    sigs = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)

    def wait() -> None:
        sig = signal.sigwait(sigs)
        name = signal.Signals(sig).name
        RECEIVED.append(sig)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and recording():
            # the last stage: when an earlier stage dies, torchrun sends this signal to the others; the
            # connection to the dead stage is seen lost meanwhile (the main thread exits 1 and the run
            # counts as a crash, not a stop: tasks.inflight). The other ranks wait longer below.
            time.sleep(STOP_GRACE)
        stop_all()  # the lines in flight did not end this run (tasks.inflight)
        if not serving:
            fail_active(f"{name} received")
        if serving:

            log.warning("rank %d: %s received, finishing in-flight requests and stopping", rank, name)
            STOPPING.set()
            backstop = threading.Timer(25.0, _hard_exit, (128 + sig,))
            backstop.daemon = True
            backstop.start()
            return
        log.error("rank %d: %s received, stopping; finished results are journaled, rerun the same command to resume",
                  rank, name)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not recording():
            time.sleep(2 * STOP_GRACE)  # the last stage records the stop before this rank's connections close
        _hard_exit(128 + sig)

    threading.Thread(target=wait, name="signals", daemon=True).start()


def watch_launcher() -> None:
    """A rank started by torchrun or launch/legacy_per_rank.sh exits (SIGTERM's way) when that launcher
    is gone, even after ``kill -9`` of it (comm.lifeline)."""

    expected = launcher_pid(os.environ, START_PPID)
    if expected is not None:
        watch(expected)


def run(opts) -> int:
    """Plan (every flag checked, nothing loaded), then execute on this rank (in-process use, tests)."""

    plan = make_plan(opts)
    for warning in plan.warnings:
        log.warning("%s", warning)
    if plan.layout_note:
        log.info("%s", plan.layout_note)
    return 0 if plan.nothing_to_do else execute(plan, opts)


def load_ahead(plan, opts, info) -> None:
    """What this rank uses later, loaded before its stage's memory account starts: the libraries count in
    its "process" (with torch), not in "other" (the tokenizer of the first and last ranks, the server's)."""
    if info.is_first or info.is_last:
        try:
            load_tokenizer(plan.model_dir, opts.trust_remote_code)  # kept: the roles take this one
        except Exception:  # noqa: BLE001 (reported where the role loads it, after the weights' own checks)
            pass
    if opts.serve is not None and info.is_first:
        import serve.run  # noqa: F401  # lazy: FastAPI and uvicorn, serve mode's only


def execute(plan, opts) -> int:
    """Start distributed, load this stage, play this rank's role; returns the exit code."""
    import torch

    set_rank(plan.rank)
    inputs, dummy = list(plan.inputs), None
    talking = bool(opts.prompts or opts.prompts_file or opts.chat)  # serve.interactive: the terminal's requests
    workload = DummyWorkload(opts.batch_size, opts.input_seq_length, opts.generate_seq_length)
    if plan.stage == 0 and not inputs and opts.serve is None and not talking:
        dummy = write_dummy_requests(workload)
        inputs = [dummy]
    torch.set_num_threads(plan.threads)
    if not torch.cuda.is_available():  # a CPU stage: activations reuse freed heap pages (see the module)
        keep_freed_memory()
    try:
        info = init_distributed(opts.rank, opts.world_size, opts.pipeline_group_size, opts.data_group_size,
                                opts.dist_url, opts.cuda_id, opts.timeout)
    except ValueError as e:  # e.g. two ranks on one GPU
        raise UsageError(str(e)) from None
    status = start_status(plan, opts, info)  # the writing rank's status file, "loading" (pipeline.runtime.monitor)
    try:
        start_metrics(opts, status)
        load_ahead(plan, opts, info)
        stage = load_stage(plan, opts, info)
        LOAD.tick()
        opts.budget = run_budget(opts, info, stage, plan)
    except BaseException as e:
        fail_active(f"{type(e).__name__}: {e}")
        raise
    last_output = None  # the profile trace goes beside the run's last output
    clean = False
    try:
        if not info.is_first:
            last_output = serve_rank(plan, opts, info, stage, status)
            clean = True
            return stopped_code() if opts.serve is not None else 0
        if talking:
            code = run_interactive(plan, opts, info, stage, first_rank)
            clean = True
            return code
        if opts.serve is not None:
            from serve.run import run_server  # lazy: FastAPI and uvicorn, 0.6 s of every other rank's start-up

            run_server(plan, opts, info, stage, first_rank)
            clean = True
            return stopped_code()
        jobs = [Job(i, output_for(i, opts.output_path, len(inputs) > 1)) for i in inputs]
        last_output = jobs[-1].output if jobs else None
        rank0 = first_rank(plan, opts, info, stage)
        rank0.stats_every = opts.status_interval
        if rank0.last is not None:
            rank0.last.status = status
        reports = rank0.drive(jobs)
        clean = True
        if status is not None:
            status.finish("finished")
        summarize(reports)
        if dummy:

            print_latency(reports[0], workload)
            for path in (dummy, jobs[0].output, jobs[0].output + ".summary.json"):
                Path(path).unlink(missing_ok=True)
        return 1 if (opts.strict and sum(r.errors for r in reports)) else 0
    except BaseException as e:
        fail_active(f"{type(e).__name__}: {e}")
        raise
    finally:
        if stage.trace is not None and last_output:
            log.info("profile trace: %s", stage.trace.save(f"{last_output}.trace-rank{info.rank}.json"))
        shutdown(info, clean)


def summarize(reports) -> None:

    for r in reports:
        if r.skipped:
            print(f"{r.input}: skipped, output already complete at {r.output}", file=sys.stderr)
            continue
        rate = r.generated_tokens / r.seconds if r.seconds else 0.0
        share = r.summary.data_group_size
        part = f" (data group {r.summary.data_rank} of {share}: its share of the lines)" if share > 1 else ""
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(r.error_kinds.items())) or "none"
        note = precision_note(r.summary.stage_precision)
        precision = f" [{note}]" if note else ""
        first, started = r.summary.first_result_seconds, r.summary.startup_seconds
        ttft = f"; first result {started + first:.1f}s after the process started" if first is not None \
            and started is not None else ""
        print(f"{r.input}: {r.requests} requests, {r.requests - r.errors} answered, {r.errors} errors ({kinds}); "
              f"{r.prompt_tokens} prompt + {r.generated_tokens} generated tokens in {r.seconds:.1f}s "
              f"({rate:.1f} tok/s) -> {r.output}{part}{precision}{ttft}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
