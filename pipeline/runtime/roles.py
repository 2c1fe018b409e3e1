"""Ranks assembled from a plan, for every face: the one start-up (:func:`start_rank`: process group,
this stage's layers and kernels, the KV budget), then rank 0's engine (:func:`make_engine`) or every
other rank's loop (:func:`serve_rank`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from comm.dist import DistInfo, init_distributed
from comm.faults import LOAD, set_rank
from pipeline.config.options import RunOptions, UsageError
from pipeline.config.plan import RunPlan, resolve_dtype
from pipeline.runtime.host_memory import keep_freed_memory, release_freed_memory
from pipeline.runtime.monitor import start_metrics, start_status, stop_metrics
from tasks.status import RunStatus, fail_active

from pipeline.config.pass_sizes import prefix_block, scheduler_config
from pipeline.loading.hub import ModelUnavailable
from pipeline.loading.stage_weights import CheckpointError, build_stage
from pipeline.models.hf_stage import UnsupportedModel
from pipeline.runtime.stage import Stage, serve
from pipeline.runtime.memory import MemoryLedger
from pipeline.loading.adapters import stage_adapters
from pipeline.runtime.trace import Trace
from pipeline.models.kernels.int8 import choose_kernels, fuse_prologues
from pipeline.models.kernels.packed import pack_stage
from pipeline.models.kernels import fp8, weight_only
from pipeline.models.kernels.kernel_table import KernelTable
from pipeline.config.budget import resolve_budget
from comm.local import LocalMessenger
from comm.p2p import Messenger
from pipeline.runtime.link import Link
from pipeline.output.head import Head
from pipeline.runtime.last_rank import LastRank
from pipeline.scheduling.driver import Driver, ModelNames
from pipeline.runtime.engine import Engine
from pipeline.runtime.sources import FileSource, Requests
from pipeline.scheduling.scheduler import Scheduler
from pipeline.cache.prefix import PrefixCache
from pipeline.config.cores import usable_cores
from pipeline.config.openmp import wait_note
from pipeline.sampling.grammar import Grammars, masks_on_thread
from pipeline.output.reasoning import ReasoningError, choose as choose_reasoning
from pipeline.scheduling.grammars import GrammarIntake
from pipeline.loading.tokenizer import load_tokenizer as load

log = logging.getLogger("runner")


def load_stage(plan, opts, info):
    """This rank's layers in the run's dtype, as a :class:`pipeline.runtime.stage.Stage`."""
    dtype = resolve_dtype(opts.torch_dtype_name, plan.config, info.device, plan.model_dir)
    first, last = plan.layers
    ledger = MemoryLedger()  # the process's RSS before anything of the stage is loaded
    t0 = time.perf_counter()
    try:
        # plan.source: a hub snapshot fetches this stage's shards as they are opened
        model, store = build_stage(plan.source or plan.model_dir, first, last, info.is_first, info.is_last, dtype, info.device,
                                   opts.model_type, opts.batch_invariant, opts.backend,
                                   None if opts.quantize == "none" else opts.quantize)
    except (CheckpointError, UnsupportedModel, ModelUnavailable) as e:
        raise UsageError(str(e)) from None
    log.info("stage %d/%d: layers [%d, %d), %d tensors, %.1fs, dtype %s%s, %d threads (%s)", info.stage,
             info.pipeline_size, first, last, len(store.loaded), time.perf_counter() - t0, dtype,
             "" if opts.quantize == "none" else f", {opts.quantize} weights", plan.threads, wait_note())
    ledger.loaded(model)  # the weights as loaded, before kernels repack them
    model.kv_int8 = opts.kv_cache_dtype == "int8"  # the plan allowed it: a native family on a CPU stage
    if opts.quantize != "none":
        choose_int8_kernels(model, dtype, opts, info.stage)
    elif plan.fingerprint.get("checkpoint_format"):
        choose_packed_kernels(model, dtype, opts, info.stage, plan.fingerprint["checkpoint_format"])
    if info.device.type == "cpu":
        pack_cpu_linears(model, dtype, opts, info)
    if plan.adapters:
        model.adapters, read = stage_adapters(plan.adapters, plan.config, plan.spec, first, last, dtype, info.device,
                                              opts.model_type)
        log.info("stage %d: %d LoRA adapters (%s), %d tensors, %.1f MiB", info.stage, len(plan.adapters),
                 ", ".join(a.name for a in plan.adapters), len(read), model.adapters.nbytes() / 2**20)
    trace = Trace(info.rank) if opts.profiling else None
    stage = Stage(model, info.device, trace, prefix_block(plan, opts))
    stage.index = info.stage
    stage.fault.set_rank(info.rank)
    del store  # the loader's handles (open shards) go before the loaded stage's RSS is read
    ledger.ready()
    stage.ledger = ledger
    return stage


def choose_int8_kernels(model, dtype, opts, stage: int) -> None:
    """The int8 kernel of each shape, from the machine's kernel table (timed on this stage's shapes, a
    decode micro-batch and a prefill chunk, where the table has none); logged and in the run summary
    (``model.quantized``). Every int8 kernel gives the same results: the choice is speed only."""
    t0 = time.perf_counter()
    table = KernelTable(opts.kernel_table)
    chosen = choose_kernels(model, dtype, (1, opts.max_micro_batch_size, 256), table, release_freed_memory)
    fused = fuse_prologues(model)
    model.quantized = {"weights": opts.quantize, "compute_dtype": str(dtype).removeprefix("torch."),
                       "kernels": {shape: c["kernel"] for shape, c in chosen.items()}, "kernel_table": table.summary()}
    log.info("stage %d: int8 kernels in %.1fs (%s; rows 1, %s and 256; median ms per kernel): %s; %d projections quantize "
             "their norm or activation in the same pass", stage, time.perf_counter() - t0, _table_note(table),
             opts.max_micro_batch_size, _kernel_note(chosen), fused)


def choose_packed_kernels(model, dtype, opts, stage: int, fmt: str) -> None:
    """A pre-quantized checkpoint (pipeline.loading.quantized): the int4 / int8 kernel of each shape from
    the machine's kernel table (timed where it has none: these kernels round differently, so the choice
    is kept, not timed again by every run); FP8: torch._scaled_mm on CUDA where it runs. Logged and in
    the run summary (``model.quantized``)."""
    t0 = time.perf_counter()
    table = KernelTable(opts.kernel_table)
    chosen = weight_only.choose_kernels(model, dtype, (opts.max_micro_batch_size, 256), table)
    kernels = {shape: c["kernel"] for shape, c in chosen.items()} | fp8.choose_kernels(model, dtype)
    model.quantized = {"weights": fmt, "compute_dtype": str(dtype).removeprefix("torch."), "kernels": kernels}
    if chosen:
        model.quantized["kernel_table"] = table.summary()
    log.info("stage %d: %s kernels chosen in %.1fs (%s; median ms per kernel): %s", stage, fmt,
             time.perf_counter() - t0, _table_note(table),
             _kernel_note(chosen) or ", ".join(f"{k} -> {v}" for k, v in kernels.items()))


def _table_note(table: KernelTable) -> str:
    return f"{table.kept} shapes from {table.path}, {table.measured} timed now"


def _kernel_note(chosen: dict) -> str:
    return "; ".join(f"{shape} -> {c['kernel']}" + (f" ({', '.join(f'{k} {v}' for k, v in c['ms'].items())})"
                                                    if c.get("ms") else "") for shape, c in chosen.items())


def pack_cpu_linears(model, dtype, opts, info) -> None:
    """A CPU stage with ``--cpu-linear onednn``: the layers' projections multiply against oneDNN's
    prepacked weights (:mod:`pipeline.models.kernels.packed`); ``model.cpu_linear`` says which kernel runs
    (the run summary's ``stage_precision``)."""
    t0 = time.perf_counter()
    n, reason = pack_stage(model, info.device, dtype, opts.batch_invariant, opts.quantize, opts.cpu_linear,
                           release_freed_memory)
    if reason is None:
        log.info("stage %d: %d linear weights prepacked for oneDNN in %.2fs", info.stage, n, time.perf_counter() - t0)
    elif opts.cpu_linear == "onednn":
        log.info("stage %d: --cpu-linear onednn not used: %s", info.stage, reason)


def run_budget(opts, info, stage, plan) -> int:
    """--budget in tokens (auto: from the memory left after loading, the least over stages)."""
    try:
        most = max((b - a for a, b in plan.ranges), default=0)
        budget = resolve_budget(opts.budget, stage.model, info.device, info.cpu_group, info.local_world_size, most,
                                info.gpu_sharers)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if opts.budget == "auto" and info.is_first:
        log.info("--budget auto: %d KV-cache tokens", budget)
    return budget


def make_link(info, stage):
    """This rank's links to its neighbours (None: a pipeline of one stage): over the process group, or
    in memory when every rank runs in this process (comm.local)."""
    if info.pipeline_size == 1:
        return None
    if info.local is not None:
        return Link(info, LocalMessenger(info.rank, info.device, info.local, stage.trace))
    return Link(info, Messenger(info.rank, info.device, info.channels, stage.trace))


@dataclass
class Rank:
    """A rank once started (:func:`start_rank`): where it is, its stage, the run's budget, its status file."""

    plan: RunPlan
    opts: RunOptions
    info: DistInfo
    stage: Stage
    budget: int
    status: RunStatus | None = None  # the writing rank's status file (file mode)
    metrics: object = None  # its --metrics-port server (pipeline.runtime.monitor.stop_metrics closes it)


def start_rank(plan, opts, info: DistInfo | None = None) -> Rank:
    """The one start-up of every rank and face: threads, the process group (``info``: this rank's place
    when every rank runs in this process), the status file, the tokenizer and server libraries ahead,
    this rank's stage, the KV budget every stage agrees on."""
    import torch

    set_rank(plan.rank)
    torch.set_num_threads(plan.threads)
    if not torch.cuda.is_available():  # a CPU stage: activations reuse freed heap pages (see the module)
        keep_freed_memory()
    try:
        info = info or init_distributed(opts.rank, opts.world_size, opts.pipeline_group_size, opts.data_group_size,
                                        opts.dist_url, opts.cuda_id, opts.timeout, opts.dist_backend)
    except ValueError as e:  # e.g. two ranks on one GPU
        raise UsageError(str(e)) from None
    status = start_status(plan, opts, info)  # the writing rank's status file, "loading"
    metrics = None
    try:
        metrics = start_metrics(opts, status)
        load_ahead(plan, opts, info)
        stage = load_stage(plan, opts, info)
        LOAD.tick()
        budget = run_budget(opts, info, stage, plan)
    except BaseException as e:
        fail_active(f"{type(e).__name__}: {e}")
        stop_metrics(metrics)
        raise
    return Rank(plan, opts, info, stage, budget, status, metrics)


def load_ahead(plan, opts, info) -> None:
    """What this rank uses later, loaded before its stage's memory account starts: the libraries count in
    its "process" (with torch), not in "other" (the tokenizer of the first and last ranks, the server's)."""
    if info.is_first or info.is_last:  # a failure is reported where the role loads it, after the weights' checks
        with contextlib.suppress(Exception):
            load_tokenizer(plan.model_dir, opts.trust_remote_code)  # kept: the roles take this one
    if opts.serve is not None and info.is_first:
        import fastapi  # noqa: F401  # lazy: serve mode's HTTP libraries, no other rank's
        import uvicorn  # noqa: F401


def last_rank(rank: Rank, tokenizer=None, grammars=None) -> LastRank:
    """The last stage's handler: the head, and the fingerprint its journals are checked against.
    ``grammars``: rank 0's compiled structured-output grammars when it is also the last rank (P = 1)."""
    plan, opts, info = rank.plan, rank.opts, rank.info
    tokenizer = tokenizer or load_tokenizer(plan.model_dir, opts.trust_remote_code)
    name = (opts.served_model_name or plan.served_name if opts.serve else None) or plan.model_name
    grammars = grammars or Grammars(tokenizer, plan.spec.vocab_size, opts.json_string_max_length)
    try:
        reasoning = choose_reasoning(tokenizer, opts.reasoning_parser)
    except ReasoningError as e:
        raise UsageError(str(e)) from None
    head = Head(rank.stage.model, tokenizer, eos_ids(plan.model_dir, tokenizer), name, opts.seed, grammars,
                masks_on_thread(info.device, info.local_world_size, usable_cores()), reasoning, opts.retry_starved)
    last = LastRank(rank.stage, info, head, plan.fingerprint, opts.overwrite, show_progress=not opts.no_progress)
    last.status, last.checkpoint_interval = rank.status, opts.checkpoint_interval
    return last


def make_engine(rank: Rank, files: FileSource | None = None, requests: Requests | None = None,
                stopping=None, arriving: bool = False) -> Engine:
    """Rank 0's engine over this rank's stage, fed by ``files`` and ``requests``; its scheduler runs serve
    mode's policy with --serve or when requests arrive over time from another face (``arriving``: the
    terminal, the Python API), else a file's."""
    plan, opts, info = rank.plan, rank.opts, rank.info
    tokenizer = load_tokenizer(plan.model_dir, opts.trust_remote_code)
    block = prefix_block(plan, opts)
    config = scheduler_config(plan, opts, info.pipeline_size, info.device.type == "cuda", rank.budget, arriving)
    sched = Scheduler(config, PrefixCache(block, rank.budget) if block else None)  # the config's policy
    models = None
    if plan.adapters:
        models = ModelNames([opts.served_model_name, plan.model_name, opts.model_name,
                             plan.source.repo_id if plan.source else None, str(Path(plan.model_dir).resolve()),
                             Path(plan.model_dir).name], [a.name for a in plan.adapters])
    grammars = Grammars(tokenizer, plan.spec.vocab_size, opts.json_string_max_length)
    driver = Driver(tokenizer, plan.spec.vocab_size, plan.spec.max_positions, sched, opts.truncate_prompts,
                    info.data_rank, info.data_size, models, GrammarIntake(grammars, opts.grammar_timeout),
                    opts.lenient_fields)
    last = last_rank(rank, tokenizer, grammars) if info.is_last else None  # P = 1: one tokenizer, rank 0's grammars
    engine = Engine(rank.stage, driver, make_link(info, rank.stage), last, files, requests, stopping, info.data_rank,
                    info.data_size)
    engine.stats_every = opts.status_interval
    return engine


def serve_rank(rank: Rank) -> str | None:
    """Every rank but the first: passes until Stop; returns the last output it saw opened."""
    link = make_link(rank.info, rank.stage)
    last = last_rank(rank) if rank.info.is_last else None
    last_output = serve(link, rank.stage, last)
    link.flush()
    return last_output


def load_tokenizer(model_dir: str, trust_remote_code: bool):
    """AutoTokenizer, or sentencepiece directly for tokenizer.model-only folders (see pipeline.loading.tokenizer).
    Kept per folder and thread: the runner loads it before the stage (its memory then counts in the
    stage's ``process``), the roles take the same object; ranks that run as threads of one process
    (``--in-process``) each have their own, since a fast tokenizer must not be used by two threads at once."""
    return _tokenizer(model_dir, trust_remote_code, threading.get_ident())


@functools.lru_cache(maxsize=16)
def _tokenizer(model_dir: str, trust_remote_code: bool, thread: int):
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
