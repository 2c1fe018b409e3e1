"""Pipeline-parallel batch inference over OpenAI-style completion request files.

    torchrun --nproc-per-node 8 dist_inference_runner.py --model-name MODEL_DIR --infer-data requests.jsonl

Each process holds a slice of the layers; rank 0 reads and schedules the requests, activations
flow down the pipeline (NCCL on GPU, gloo on CPU) and the last rank writes one OpenAI-format
result per request, in input order, to ``output_<input name>`` beside the input.
The seed's per-rank launch works too:
``python dist_inference_runner.py ... --rank i --world-size P --pipeline-group-size P --dist-url tcp://HOST:PORT``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("runner")

from pipeline.options import UsageError  # noqa: E402  (light: no torch; after the sys.path line above)


def setup_logging(rank: int) -> None:
    level = os.environ.get("DIST_INFER_LOG", "INFO").upper()
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"[rank {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def main(argv: list[str] | None = None, signals: bool = True) -> int:
    """Parse and plan (a flag that cannot work exits 2 here, before any loading), then execute.

    ``signals=False`` leaves signal handling to an in-process caller (tests); otherwise SIGTERM and
    SIGINT are masked before anything (torch's import included) can start a thread.
    """
    from pipeline.options import parse_options

    opts = parse_options(argv)  # exits 2 with a message on bad flags
    rank = opts.rank if opts.rank is not None else int(os.environ.get("RANK", 0))
    setup_logging(rank)
    if signals:
        watch_signals(rank, serving=opts.serve is not None)
    from pipeline.plan import make_plan

    try:
        plan = make_plan(opts)
    except UsageError as e:
        return usage_error(e)
    for warning in plan.warnings:
        log.warning("%s", warning)
    try:
        return execute(plan, opts)
    except UsageError as e:
        return usage_error(e)
    except Exception as e:  # noqa: BLE001 - one clear line per failing rank, then exit without hanging
        from comm.p2p import PeerLost
        from pipeline.first_rank import RunError

        if isinstance(e, (PeerLost, RunError)):
            log.error("rank %d stops: %s", rank, e)
        else:
            log.exception("rank %d failed: %s", rank, e)
        log.error("rank %d: finished results are journaled; rerun the same command to resume", rank)
        _hard_exit(1)


def usage_error(e: UsageError) -> int:
    print(f"dist_inference_runner.py: error: {e}", file=sys.stderr)
    return 2


def _hard_exit(code: int) -> None:
    """Exit now: a process group whose peer died can hang in its destructor."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
        if serving:
            from serve.source import STOPPING

            log.warning("rank %d: %s received, finishing in-flight requests and stopping", rank, name)
            STOPPING.set()
            backstop = threading.Timer(25.0, _hard_exit, (128 + sig,))
            backstop.daemon = True
            backstop.start()
            return
        log.error("rank %d: %s received, stopping; finished results are journaled, rerun the same command to resume",
                  rank, name)
        _hard_exit(128 + sig)

    threading.Thread(target=wait, name="signals", daemon=True).start()


def run(opts) -> int:
    """Plan (every flag checked, nothing loaded), then execute on this rank (in-process use, tests)."""
    from pipeline.plan import make_plan

    plan = make_plan(opts)
    for warning in plan.warnings:
        log.warning("%s", warning)
    return execute(plan, opts)


def execute(plan, opts) -> int:
    """Start distributed, load this stage, play this rank's role; returns the exit code."""
    import torch

    from comm.dist import init_distributed, shutdown
    from comm.faults import LOAD, set_rank

    from pipeline.first_rank import Job
    from pipeline.plan import output_for

    set_rank(plan.rank)
    inputs, dummy = list(plan.inputs), None
    if plan.stage == 0 and not inputs and opts.serve is None:
        from tasks.dummy import write_dummy_requests

        dummy = write_dummy_requests(opts)
        inputs = [dummy]
    torch.set_num_threads(plan.threads)
    info = init_distributed(opts.rank, opts.world_size, opts.pipeline_group_size, opts.data_group_size,
                            opts.dist_url, opts.cuda_id, opts.timeout)
    stage = load_stage(plan, opts, info)
    LOAD.tick()
    last_output = None  # the profile trace goes beside the run's last output
    try:
        if not info.is_first:
            last_output = serve_rank(plan, opts, info, stage)
            return 0
        if opts.serve is not None:
            from serve.run import run_server

            run_server(plan, opts, info, stage, first_rank)
            return 0
        jobs = [Job(i, output_for(i, opts.output_path, len(inputs) > 1)) for i in inputs]
        last_output = jobs[-1].output if jobs else None
        reports = first_rank(plan, opts, info, stage).drive(jobs)
        summarize(reports)
        if dummy:
            from tasks.dummy import print_latency

            print_latency(reports[0], opts)
            for path in (dummy, jobs[0].output, jobs[0].output + ".summary.json"):
                Path(path).unlink(missing_ok=True)
        return 1 if (opts.strict and sum(r.errors for r in reports)) else 0
    finally:
        if stage.trace is not None and last_output:
            log.info("profile trace: %s", stage.trace.save(f"{last_output}.trace-rank{info.rank}.json"))
        shutdown()


def load_stage(plan, opts, info):
    """This rank's layers in the run's dtype, as a :class:`pipeline.stage.Stage`."""
    from pipeline.loading import CheckpointError, build_stage
    from pipeline.stage import Stage

    dtype = resolve_dtype(opts.torch_dtype_name, plan.config, info.device)
    first, last = plan.layers
    t0 = time.perf_counter()
    try:
        model, store = build_stage(plan.model_dir, first, last, info.is_first, info.is_last, dtype, info.device,
                                   opts.model_type, opts.batch_invariant)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    log.info("stage %d/%d: layers [%d, %d), %d tensors, %.1fs, dtype %s, %d threads", info.stage,
             info.pipeline_size, first, last, len(store.loaded), time.perf_counter() - t0, dtype, plan.threads)
    trace = None
    if opts.profiling:
        from pipeline.trace import Trace

        trace = Trace(info.rank)
    return Stage(model, info.device, trace)


def make_link(info, stage):
    from comm.p2p import Messenger
    from pipeline.link import Link

    return Link(info, Messenger(info.device, stage.trace)) if info.pipeline_size > 1 else None


def last_rank(plan, opts, info, stage, tokenizer=None):
    """The last stage's handler: the head, and the fingerprint its journals are checked against."""
    from pipeline.head import Head
    from pipeline.last_rank import LastRank

    tokenizer = tokenizer or load_tokenizer(plan.model_dir, opts.trust_remote_code)
    name = (opts.served_model_name if opts.serve else None) or plan.model_name
    head = Head(stage.model, tokenizer, eos_ids(plan.model_dir, tokenizer), name, opts.seed)
    fingerprint = {"model": str(Path(plan.model_dir).resolve()), "seed": opts.seed,
                   "dtype": str(next(stage.model.parameters()).dtype), "max_layers": opts.max_layers,
                   "truncate_prompts": opts.truncate_prompts, "data_group_size": info.data_size,
                   "batch_invariant": opts.batch_invariant}
    return LastRank(stage, info, head, fingerprint, opts.overwrite, show_progress=not opts.no_progress)


def first_rank(plan, opts, info, stage):
    from pipeline.driver import Driver
    from pipeline.first_rank import FirstRank
    from pipeline.schedule import Scheduler

    tokenizer = load_tokenizer(plan.model_dir, opts.trust_remote_code)
    sched = Scheduler(opts.budget, plan.slots, opts.max_micro_batch_size)
    driver = Driver(tokenizer, plan.spec.vocab_size, plan.spec.max_positions, sched, opts.truncate_prompts,
                    info.data_rank, info.data_size)
    last = last_rank(plan, opts, info, stage, tokenizer) if info.is_last else None  # P = 1: one tokenizer
    return FirstRank(stage, driver, make_link(info, stage), last, info.data_rank, info.data_size)


def serve_rank(plan, opts, info, stage) -> str | None:
    """Every rank but the first; returns the last output it saw opened."""
    from pipeline.stage import serve

    link = make_link(info, stage)
    last_output = serve(link, stage, last_rank(plan, opts, info, stage) if info.is_last else None)
    link.flush()
    return last_output


def resolve_dtype(name: str, cfg: dict, device) -> "torch.dtype":
    import torch

    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        name = cfg.get("dtype") or cfg.get("torch_dtype") or "float16"
        if name not in table:
            raise UsageError(f"the checkpoint's dtype {name!r} is not supported; pass --dtype float16, bfloat16 or float32")
    return table[name]


def load_tokenizer(model_dir: str, trust_remote_code: bool):
    """AutoTokenizer, or sentencepiece directly for tokenizer.model-only folders (see pipeline.tokenizer)."""
    from pipeline.loading import CheckpointError
    from pipeline.tokenizer import load_tokenizer as load

    try:
        return load(model_dir, trust_remote_code)
    except CheckpointError as e:
        raise UsageError(str(e)) from None


def eos_ids(model_dir: str, tokenizer) -> set[int]:
    """EOS tokens: the tokenizer's, plus generation_config.json's (Llama 3 lists several)."""
    import json

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(e if isinstance(e, list) else [e] if e is not None else [])
    return ids


def summarize(reports) -> None:
    for r in reports:
        if r.skipped:
            print(f"{r.input}: skipped, output already complete at {r.output}", file=sys.stderr)
            continue
        rate = r.generated_tokens / r.seconds if r.seconds else 0.0
        share = r.summary.data_group_size
        part = f" (data group {r.summary.data_rank} of {share}: its share of the lines)" if share > 1 else ""
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(r.error_kinds.items())) or "none"
        print(f"{r.input}: {r.requests} requests, {r.requests - r.errors} answered, {r.errors} errors ({kinds}); "
              f"{r.prompt_tokens} prompt + {r.generated_tokens} generated tokens in {r.seconds:.1f}s "
              f"({rate:.1f} tok/s) -> {r.output}{part}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
