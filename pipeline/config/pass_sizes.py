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
    if opts.prefix_cache != "on" or opts.batch_invariant or not resumable(plan.spec):
        return 0
    return opts.prefix_block_size


def resumable(spec) -> bool:
    """Whether a prompt can resume after tokens already in the cache: a native family (the generic stage
    keeps its cache its own way) without longrope."""
    return isinstance(spec, DecoderSpec) and not (spec.rope is not None and spec.rope.scaling_type == "longrope")


def prefill_chunk(plan, opts, pipeline_size: int, gpu: bool = False) -> int:
    """Prompt tokens a pass computes per chunkable prompt, 0 for whole prompts (``--prefill-chunk``).
    A chunk resumes after the prompt's earlier tokens in the cache, as a prefix-cache hit does: the
    same stages that cannot hold a prefix pool cannot chunk (:func:`prefix_block`)."""
    chunk = opts.prefill_chunk
    if chunk == "auto":
        chunk = AUTO_PREFILL_CHUNK["cuda" if gpu else "cpu"] if pipeline_size > 1 and not opts.batch_invariant else 0
    if chunk and not resumable(plan.spec):
        if opts.prefill_chunk != "auto":
            log.warning("--prefill-chunk %d ignored: this model's stage computes whole prompts only (the generic "
                        "transformers stage, or longrope)", chunk)
        return 0
    return chunk


def pass_prefill_tokens(pipeline_size: int, gpu: bool = False) -> int:
    """Prompt tokens one pass computes (chunks of longer prompts included; at least one prompt's): 2048 for
    a pipeline of CPU stages, whose passes should be of even length (docs/design/chunked-prefill.md); one
    stage and GPUs keep :data:`~pipeline.config.components.PREFILL_TOKENS`."""
    return 2048 if pipeline_size > 1 and not gpu else PREFILL_TOKENS


def pass_scoring_tokens(pipeline_size: int, gpu: bool = False) -> int:
    """Prompt tokens a pass of scoring prompts alone computes (echo, ``max_tokens`` 0: no decode rows): 256
    for a pipeline of CPU stages, which pays about one pass at each end of a prefill-only file
    (docs/design/chunked-prefill.md); one stage and GPUs keep their prefill cap."""
    return 256 if pipeline_size > 1 and not gpu else pass_prefill_tokens(pipeline_size, gpu)
