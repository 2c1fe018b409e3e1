"""Rank 0, middle and last ranks assembled from a plan: the stage's layers (with adapters, int8
kernels and the prefix block size), the KV budget, the links between stages, the driver and the head.

``dist_inference_runner.execute`` calls these after the process groups exist; serve mode builds rank 0
with :func:`first_rank` as file mode does.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pipeline.config.options import UsageError
from pipeline.loading.stage_weights import CheckpointError, build_stage
from pipeline.models.hf_stage import UnsupportedModel
from pipeline.config.plan import resolve_dtype
from pipeline.runtime.stage import Stage
from pipeline.loading.adapters import stage_adapters
from pipeline.runtime.trace import Trace
from pipeline.models.kernels.int8 import choose_kernels, fuse_prologues
from pipeline.models.kernels.packed import pack_stage
from pipeline.config.budget import resolve_budget
from pipeline.models.families import DecoderSpec
from pipeline.config.options import AUTO_PREFILL_CHUNK
from pipeline.scheduling.scheduler import PREFILL_TOKENS
from comm.p2p import Messenger
from pipeline.runtime.link import Link
from pipeline.output.head import Head
from pipeline.runtime.last_rank import LastRank
from pipeline.scheduling.driver import Driver
from pipeline.runtime.first_rank import FirstRank
from pipeline.scheduling.scheduler import Scheduler
from pipeline.cache.prefix import PrefixCache
from pipeline.scheduling.driver import ModelNames
from pipeline.runtime.stage import serve
from pipeline.loading.tokenizer import load_tokenizer as load

log = logging.getLogger("runner")


def load_stage(plan, opts, info):
    """This rank's layers in the run's dtype, as a :class:`pipeline.runtime.stage.Stage`."""

    dtype = resolve_dtype(opts.torch_dtype_name, plan.config, info.device, plan.model_dir)
    first, last = plan.layers
    t0 = time.perf_counter()
    try:
        model, store = build_stage(plan.model_dir, first, last, info.is_first, info.is_last, dtype, info.device,
                                   opts.model_type, opts.batch_invariant, opts.backend,
                                   None if opts.quantize == "none" else opts.quantize)
    except (CheckpointError, UnsupportedModel) as e:
        raise UsageError(str(e)) from None
    log.info("stage %d/%d: layers [%d, %d), %d tensors, %.1fs, dtype %s%s, %d threads", info.stage,
             info.pipeline_size, first, last, len(store.loaded), time.perf_counter() - t0, dtype,
             "" if opts.quantize == "none" else f", {opts.quantize} weights", plan.threads)
    model.kv_int8 = opts.kv_cache_dtype == "int8"  # the plan allowed it: a native family on a CPU stage
    if opts.quantize != "none":
        choose_int8_kernels(model, dtype, opts, info.stage)
    if info.device.type == "cpu":
        pack_cpu_linears(model, dtype, opts, info)
    if plan.adapters:

        model.adapters, read = stage_adapters(plan.adapters, plan.config, plan.spec, first, last, dtype, info.device,
                                              opts.model_type)
        log.info("stage %d: %d LoRA adapters (%s), %d tensors, %.1f MiB", info.stage, len(plan.adapters),
                 ", ".join(a.name for a in plan.adapters), len(read), model.adapters.nbytes() / 2**20)
    trace = None
    if opts.profiling:

        trace = Trace(info.rank)
    return Stage(model, info.device, trace, prefix_block(plan, opts))


def choose_int8_kernels(model, dtype, opts, stage: int) -> None:
    """Time the int8 kernels on this stage's shapes (a decode micro-batch, a prefill chunk), keep the
    faster per shape; the choice is logged and goes into the run summary (``model.quantized``)."""

    t0 = time.perf_counter()
    chosen = choose_kernels(model, dtype, (opts.max_micro_batch_size, 256))
    fused = fuse_prologues(model)
    model.quantized = {"weights": opts.quantize, "compute_dtype": str(dtype).removeprefix("torch."),
                       "kernels": {shape: c["kernel"] for shape, c in chosen.items()}}
    log.info("stage %d: int8 kernels timed in %.1fs (rows %d and 256; best ms per kernel): %s; %d projections "
             "quantize their norm or activation in the same pass", stage, time.perf_counter() - t0,
             opts.max_micro_batch_size,
             "; ".join(f"{shape} -> {c['kernel']} ({', '.join(f'{k} {v}' for k, v in c['ms'].items())})"
                       for shape, c in chosen.items()), fused)


def pack_cpu_linears(model, dtype, opts, info) -> None:
    """A CPU stage with ``--cpu-linear onednn``: the layers' projections multiply against oneDNN's
    prepacked weights (:mod:`pipeline.models.kernels.packed`); ``model.cpu_linear`` says which kernel runs
    (the run summary's ``stage_precision``)."""

    t0 = time.perf_counter()
    n, reason = pack_stage(model, info.device, dtype, opts.batch_invariant, opts.quantize, opts.cpu_linear)
    if reason is None:
        log.info("stage %d: %d linear weights prepacked for oneDNN in %.2fs", info.stage, n, time.perf_counter() - t0)
    elif opts.cpu_linear == "onednn":
        log.info("stage %d: --cpu-linear onednn not used: %s", info.stage, reason)


def run_budget(opts, info, stage, plan=None) -> int:
    """--budget in tokens (auto: from the memory left after loading, the least over stages)."""

    try:
        most = max((b - a for a, b in plan.ranges), default=0) if plan is not None else 0
        budget = resolve_budget(opts.budget, stage.model, info.device, info.cpu_group, info.local_world_size, most)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if opts.budget == "auto" and info.is_first:
        log.info("--budget auto: %d KV-cache tokens", budget)
    return budget


def prefix_block(plan, opts) -> int:
    """The prefix cache's block size, 0 when it is off. Every rank derives the same answer. Off with
    --batch-invariant (a cached prefix would make a row's numbers depend on what ran before it), for
    longrope models (a prefix's keys depend on the length of the prompt that computed them) and on
    the generic transformers stage."""

    if opts.prefix_cache != "on" or opts.batch_invariant or not isinstance(plan.spec, DecoderSpec):
        return 0  # the generic stage keeps its cache its own way: no prefix pool there (yet)
    if plan.spec.rope is not None and plan.spec.rope.scaling_type == "longrope":
        return 0
    return opts.prefix_block_size


def prefill_chunk(plan, opts, pipeline_size: int, gpu: bool = False) -> int:
    """Prompt tokens a pass computes per chunkable prompt, 0 for whole prompts (``--prefill-chunk``).
    A chunk resumes after the prompt's earlier tokens in the cache, as a prefix-cache hit does: the
    same stages that cannot hold a prefix pool cannot chunk (:func:`prefix_block`)."""

    chunk = opts.prefill_chunk
    if chunk == "auto":
        chunk = AUTO_PREFILL_CHUNK["cuda" if gpu else "cpu"] if pipeline_size > 1 and not opts.batch_invariant else 0
    resumable = isinstance(plan.spec, DecoderSpec) and not (
        plan.spec.rope is not None and plan.spec.rope.scaling_type == "longrope")
    if chunk and not resumable:
        if opts.prefill_chunk != "auto":
            log.warning("--prefill-chunk %d ignored: this model's stage computes whole prompts only (the generic "
                        "transformers stage, or longrope)", chunk)
        return 0
    return chunk


def pass_prefill_tokens(pipeline_size: int, gpu: bool = False) -> int:
    """Prompt tokens one pass computes (chunks of longer prompts included; at least one prompt's).

    A pipeline of CPU stages wants passes of even length: a pass of 45 prompts' 64-token chunks
    (2880 tokens) took ~1.9 s on a stage where a 64-row decode step takes ~0.1 s, and while it ran the
    other stage ran out of work. On the benchmark's generation file at P = 2 (2 cores) 1024 or 2048
    tokens a pass measured alike (44.6-47.4 s, stages busy 91-94%) against 53.3 s with 8192 counting
    chunks and 48.8 s with 512; on its mixed file (generation and echo scoring) 2048 did better
    (53.9-55.0 s against 54.6-59.0 s with 1024, busy 87%), as fewer of its whole scoring prompts
    wait a pass for room. One stage has no one to wait for: it keeps
    :data:`~pipeline.scheduling.scheduler.PREFILL_TOKENS`. So do GPU pipelines, unmeasured (no GPU here): a GPU
    computes a few hundred tokens in about a decode step's time, so its passes are far more even,
    and what cap pays there is for a GPU run to tell."""

    return 2048 if pipeline_size > 1 and not gpu else PREFILL_TOKENS


def pass_scoring_tokens(pipeline_size: int, gpu: bool = False) -> int:
    """Prompt tokens a pass of scoring prompts alone computes (echo, ``max_tokens`` 0: no decode rows).

    A scoring file is prefill passes only, and a pipeline pays about one pass at each end (the last
    stage waits for the first pass to come through, the first stage for the last pass to leave): with
    1024-token passes that was ~18% of the benchmark's scoring file at P = 2 on 2 CPU cores (4.1-4.5 s,
    stages busy 80-87%, 14 passes); at most 512 tokens 3.8-4.0 s (87-92%), 256 3.8-3.9 s (89-94%;
    P = 1: 3.6 s). Generation keeps :func:`pass_prefill_tokens`: there smaller passes admitted prompts
    more slowly (512: 48.8 s against 44.6-47.4 with 1024-2048). One stage and GPUs keep their prefill
    cap. On a tiny model, where a pass's fixed cost dominates, the smaller passes cost a little (the
    default model's helm_scoring.jsonl at P = 2: 0.5 -> 0.6 s)."""
    return 256 if pipeline_size > 1 and not gpu else pass_prefill_tokens(pipeline_size, gpu)


def make_link(info, stage):

    return Link(info, Messenger(info.rank, info.device, info.channels, stage.trace)) if info.pipeline_size > 1 else None


def last_rank(plan, opts, info, stage, tokenizer=None):
    """The last stage's handler: the head, and the fingerprint its journals are checked against."""

    tokenizer = tokenizer or load_tokenizer(plan.model_dir, opts.trust_remote_code)
    name = (opts.served_model_name if opts.serve else None) or plan.model_name
    head = Head(stage.model, tokenizer, eos_ids(plan.model_dir, tokenizer), name, opts.seed)
    return LastRank(stage, info, head, plan.fingerprint, opts.overwrite, show_progress=not opts.no_progress)


def first_rank(plan, opts, info, stage):

    tokenizer = load_tokenizer(plan.model_dir, opts.trust_remote_code)

    block = prefix_block(plan, opts)
    gpu = info.device.type == "cuda"
    chunk = prefill_chunk(plan, opts, info.pipeline_size, gpu)
    sched = Scheduler(opts.budget, plan.slots, opts.max_micro_batch_size,
                      prefix=PrefixCache(block, opts.budget) if block else None, chunk=chunk,
                      prefill_tokens=pass_prefill_tokens(info.pipeline_size, gpu),
                      scoring_tokens=pass_scoring_tokens(info.pipeline_size, gpu), stages=info.pipeline_size)
    models = None
    if plan.adapters:

        models = ModelNames([opts.served_model_name, plan.model_name, opts.model_name,
                             str(Path(plan.model_dir).resolve())], [a.name for a in plan.adapters])
    driver = Driver(tokenizer, plan.spec.vocab_size, plan.spec.max_positions, sched, opts.truncate_prompts,
                    info.data_rank, info.data_size, models, chunk)
    last = last_rank(plan, opts, info, stage, tokenizer) if info.is_last else None  # P = 1: one tokenizer
    return FirstRank(stage, driver, make_link(info, stage), last, info.data_rank, info.data_size)


def serve_rank(plan, opts, info, stage) -> str | None:
    """Every rank but the first; returns the last output it saw opened."""

    link = make_link(info, stage)
    last_output = serve(link, stage, last_rank(plan, opts, info, stage) if info.is_last else None)
    link.flush()
    return last_output


def load_tokenizer(model_dir: str, trust_remote_code: bool):
    """AutoTokenizer, or sentencepiece directly for tokenizer.model-only folders (see pipeline.loading.tokenizer)."""

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
