"""Small typed configs, one per component, that the plan's factory resolves from the options once
(vLLM's ``SchedulerConfig`` beside its ``CacheConfig``): a component below the plan takes its config,
never ``RunOptions``. Plain frozen dataclasses; this module imports nothing of the project.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_TOKENS = 8192  # prompt tokens a pass admits; more wait for the slot's next passes (see Scheduler)


@dataclass(frozen=True)
class SchedulerConfig:
    """Every size the scheduler (:class:`pipeline.scheduling.scheduler.Scheduler`) works with, and its mode.

    ``budget``: KV cells (rows x columns over the micro-batches, plus the prefix pool); ``num_slots``:
    micro-batches; ``max_rows``: rows a micro-batch takes; ``window``: queued groups it looks ahead
    over (default max(64, 4 x max_rows)); ``prefill_tokens``: prompt tokens one pass computes (rows x
    the longest part, at least one prompt's); ``scoring_tokens``: the same for a pass of scoring
    prompts alone (default ``prefill_tokens``); ``chunk``: prompt tokens a pass computes of a
    chunkable prompt (0: whole prompts); ``stages``: pipeline stages (P); ``serve``: requests arrive
    over HTTP (the serve policy, :mod:`pipeline.scheduling.policy`), else they come from files;
    ``turns``: the stages' threads add up to more than the node's cores (``RunPlan.turns``), so a
    slot's decode rows are never split over passes for every stage (they would only contend)."""

    budget: int
    num_slots: int
    max_rows: int
    window: int | None = None
    prefill_tokens: int = PREFILL_TOKENS
    scoring_tokens: int | None = None
    chunk: int = 0
    stages: int = 1
    serve: bool = False
    turns: bool = False  # the stages share this node's cores and take turns with all of them: no tail split

    @property
    def look_ahead(self) -> int:
        return self.window or max(64, 4 * self.max_rows)

    @property
    def scoring_cap(self) -> int:
        return self.scoring_tokens or self.prefill_tokens
