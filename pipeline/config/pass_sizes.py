"""The scheduler's sizes and mode, resolved once from the options into a
:class:`~pipeline.config.components.SchedulerConfig`: pass sizes, chunked prefill, micro-batches,
file or serve (which policy it runs, :mod:`pipeline.scheduling.policy`); and the prefix cache's block size.

Rank 0's factory (:func:`pipeline.runtime.roles.make_engine`) calls :func:`scheduler_config` with the
run's budget once it is known (``--budget auto`` needs the loaded stage); every rank derives the same
:func:`prefix_block` for its prefix pool.
"""

from __future__ import annotations

import logging

from pipeline.config.options import AUTO_PREFILL_CHUNK
from pipeline.models.families import DecoderSpec
from pipeline.config.components import PREFILL_TOKENS, SchedulerConfig

log = logging.getLogger("runner")


def scheduler_config(plan, opts, pipeline_size: int, gpu: bool, budget: int, arriving: bool = False) -> SchedulerConfig:
    """Every size the scheduler works with, for this run (a pipeline of ``pipeline_size`` stages, the
    budget in KV cells once resolved); serve mode (``--serve``) sizes micro-batches for requests still
    to come, a file knows its requests (``arriving``: requests come over time from another face too)."""
    return SchedulerConfig(budget, plan.slots, opts.max_micro_batch_size,
                           prefill_tokens=pass_prefill_tokens(pipeline_size, gpu),
                           scoring_tokens=pass_scoring_tokens(pipeline_size, gpu),
                           chunk=prefill_chunk(plan, opts, pipeline_size, gpu), stages=pipeline_size,
                           serve=bool(opts.serve) or arriving, turns=plan.turns)


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
    :data:`~pipeline.config.components.PREFILL_TOKENS`. So do GPU pipelines, unmeasured (no GPU here): a GPU
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
