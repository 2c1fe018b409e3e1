"""Pipeline-parallel batch inference over OpenAI-style completion request files.

    torchrun --nproc-per-node 8 dist_inference_runner.py --model-name MODEL_DIR --infer-data requests.jsonl

Each process holds a slice of the layers; rank 0 reads and schedules the requests, activations
flow down the pipeline (NCCL on GPU, gloo on CPU) and the last rank writes one OpenAI-format
result per request, in input order, to ``output_<input name>`` beside the input.
The seed's per-rank launch works too:
``python dist_inference_runner.py ... --rank i --world-size P --pipeline-group-size P --dist-url tcp://HOST:PORT``.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("runner")


class UsageError(ValueError):
    """A problem with how the runner was invoked; reported without a traceback."""


def setup_logging(rank: int) -> None:
    level = os.environ.get("DIST_INFER_LOG", "INFO").upper()
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"[rank {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def resolve_inputs(opts) -> list[str]:
    """--infer-data as given (files, globs, directories), or the PATH of a NAME#PATH job name."""
    specs = opts.infer_data
    if not specs:
        job = opts.job_name or os.environ.get("LSB_JOBNAME") or os.environ.get("SLURM_JOB_NAME") or ""
        if "#" in job:
            specs = [job.split("#", 1)[1]]
    files: list[str] = []
    for spec in specs or []:
        p = Path(spec)
        if p.is_dir():
            found = sorted(str(x) for x in p.glob("*.jsonl") if not x.name.startswith("output_"))
        elif any(c in spec for c in "*?["):
            found = sorted(x for x in glob.glob(spec) if not Path(x).name.startswith("output_"))
        elif p.is_file():
            found = [spec]
        else:
            raise UsageError(f"--infer-data {spec}: no such file or directory")
        if not found:
            raise UsageError(f"--infer-data {spec}: matches no .jsonl files")
        files += found
    return files


def output_for(input_path: str, output_path: str | None, several: bool) -> str:
    name = "output_" + Path(input_path).name
    if output_path is None:
        return str(Path(input_path).with_name(name))
    return str(Path(output_path) / name) if several else output_path


def main(argv: list[str] | None = None) -> int:
    from pipeline.options import parse_options

    opts = parse_options(argv)  # exits 2 with a message on bad flags
    rank = opts.rank if opts.rank is not None else int(os.environ.get("RANK", 0))
    setup_logging(rank)
    watch_signals(rank)
    try:
        return run(opts)
    except UsageError as e:
        print(f"dist_inference_runner.py: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - one clear line per failing rank, then exit without hanging
        from comm.p2p import PeerLost
        from pipeline.engine import RunError

        if isinstance(e, (PeerLost, RunError)):
            log.error("rank %d stops: %s", rank, e)
        else:
            log.exception("rank %d failed: %s", rank, e)
        log.error("rank %d: finished results are journaled; rerun the same command to resume", rank)
        _hard_exit(1)


def _hard_exit(code: int) -> None:
    """Exit now: a process group whose peer died can hang in its destructor."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def watch_signals(rank: int) -> None:
    """SIGTERM (preemption) and SIGINT stop every rank promptly, even inside a blocking receive.

    Python runs signal handlers only between bytecodes, never while the main thread waits in a
    gloo/NCCL call, so the signals are blocked in every thread and a dedicated thread waits for them.
    The journal is flushed after every write, so what finished is kept.
    """
    import signal
    import threading

    sigs = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)

    def wait() -> None:
        sig = signal.sigwait(sigs)
        name = signal.Signals(sig).name
        log.error("rank %d: %s received, stopping; finished results are journaled, rerun the same command to resume",
                  rank, name)
        _hard_exit(128 + sig)

    threading.Thread(target=wait, name="signals", daemon=True).start()


def run(opts) -> int:
    import torch

    from comm.dist import init_distributed, resolve_layout, shutdown
    from pipeline.loading import CheckpointError, build_stage, read_config
    from pipeline.models import spec_from_config
    from pipeline.partition import stage_ranges

    # ---- everything that can fail without a model fails here, before any loading ----
    try:
        rank, world, _, local_world, pipeline, data = resolve_layout(
            opts.rank, opts.world_size, opts.pipeline_group_size, opts.data_group_size)
        if opts.model_name is None:
            from examples.default_model import default_model_dir

            model_dir = default_model_dir()
        else:
            model_dir = opts.model_name
        cfg = read_config(model_dir)
        spec = spec_from_config(cfg, opts.model_type)
        ranges = stage_ranges(spec.num_layers, pipeline, opts.num_layers, opts.max_layers)
        inputs = resolve_inputs(opts) if rank % pipeline == 0 else []
    except (ValueError, CheckpointError) as e:
        raise UsageError(str(e)) from None
    dummy = None
    if rank % pipeline == 0 and not inputs:
        from tasks.dummy import write_dummy_requests

        dummy = write_dummy_requests(opts)
        inputs = [dummy]
    threads = opts.num_threads or max(1, (os.cpu_count() or 1) // max(1, local_world))
    torch.set_num_threads(threads)

    info = init_distributed(opts.rank, opts.world_size, opts.pipeline_group_size, opts.data_group_size,
                            opts.dist_url, opts.cuda_id, opts.timeout)
    dtype = resolve_dtype(opts.torch_dtype_name, cfg, info.device)
    first, last = ranges[info.stage]
    t0 = time.perf_counter()
    try:
        model, store = build_stage(model_dir, first, last, info.is_first, info.is_last, dtype, info.device, opts.model_type)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    from comm.faults import maybe_fail

    maybe_fail("load", info.rank)
    log.info("stage %d/%d: layers [%d, %d), %d tensors, %.1fs, dtype %s, %d threads",
             info.stage, info.pipeline_size, first, last, len(store.loaded), time.perf_counter() - t0, dtype, threads)

    from comm.p2p import Messenger
    from pipeline.engine import Engine, Job, StageRunner

    trace = None
    if opts.profiling:
        from pipeline.trace import Trace

        trace = Trace(info.rank)
    messenger = Messenger(info.device, trace) if info.world_size > 1 else None
    runner = StageRunner(model, info.device, trace)
    model_label = opts.model_name or "tiny-llama-default-v2"
    driver = head = None
    tokenizer = load_tokenizer(model_dir, opts.trust_remote_code) if (info.is_first or info.is_last) else None
    if info.is_first:
        from pipeline.driver import Driver
        from pipeline.schedule import Scheduler

        slots = opts.num_micro_batches or info.pipeline_size
        sched = Scheduler(opts.budget, slots, opts.max_micro_batch_size)
        driver = Driver(tokenizer, spec.vocab_size, spec.max_positions, sched, opts.truncate_prompts,
                        info.data_rank, info.data_size)
    if info.is_last:
        from pipeline.head import Head

        head = Head(model, tokenizer, eos_ids(model_dir, tokenizer), Path(model_label).name, opts.seed, None)
    fingerprint = {"model": str(Path(model_dir).resolve()), "seed": opts.seed, "dtype": str(dtype),
                   "max_layers": opts.max_layers, "truncate_prompts": opts.truncate_prompts,
                   "data_group_size": info.data_size}
    engine = Engine(info, runner, messenger, driver, head, fingerprint, opts.overwrite,
                    show_progress=not opts.no_progress, trace=trace)
    if head is not None:
        head.emit = lambda index, line: engine.writer.put(index, line)
    try:
        if info.is_first:
            jobs = [Job(i, output_for(i, opts.output_path, len(inputs) > 1)) for i in inputs]
            reports = engine.drive(jobs)
            summarize(reports)
            if dummy:
                from tasks.dummy import print_latency

                print_latency(reports[0], opts)
                for path in (dummy, jobs[0].output, jobs[0].output + ".summary.json"):
                    Path(path).unlink(missing_ok=True)
            failed = sum(r.errors for r in reports)
            return 1 if (opts.strict and failed) else 0
        engine.serve()
        return 0
    finally:
        shutdown()


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
    """AutoTokenizer, or sentencepiece directly for tokenizer.model-only folders (see pipeline.loading)."""
    from pipeline.loading import CheckpointError, load_tokenizer as load

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
        share = r.summary.get("data_group_size", 1)
        part = f" (data group {r.summary['data_rank']} of {share}: its share of the lines)" if share > 1 else ""
        kinds = ", ".join(f"{k}: {v}" for k, v in sorted(r.error_kinds.items())) or "none"
        print(f"{r.input}: {r.requests} requests, {r.requests - r.errors} answered, {r.errors} errors ({kinds}); "
              f"{r.prompt_tokens} prompt + {r.generated_tokens} generated tokens in {r.seconds:.1f}s "
              f"({rate:.1f} tok/s) -> {r.output}{part}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
