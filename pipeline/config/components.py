"""Small typed configs, one per component, that the plan's factory resolves from the options once
(vLLM's ``SchedulerConfig`` beside its ``CacheConfig``): a component below the plan takes its config,
never ``RunOptions``. Plain frozen dataclasses; this module imports nothing of the project.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_TOKENS = 8192  # prompt tokens a pass admits; more wait for the slot's next passes (see Scheduler)


@dataclass(frozen=True)
class SchedulerConfig:
    """Every size the scheduler (:class:`pipeline.scheduling.scheduler.Scheduler`) works with, and its mode."""

    budget: int  # KV cells (rows x columns over the micro-batches, plus the prefix pool)
    num_slots: int  # micro-batches
    max_rows: int  # rows a micro-batch takes
    window: int | None = None  # queued groups it looks ahead over (default max(64, 4 x max_rows))
    prefill_tokens: int = PREFILL_TOKENS  # prompt tokens a pass computes (rows x the longest part; >= a prompt)
    scoring_tokens: int | None = None  # the same for a pass of scoring prompts alone (default prefill_tokens)
    chunk: int = 0  # prompt tokens a pass computes of a chunkable prompt (0: whole prompts)
    stages: int = 1  # pipeline stages (P)
    serve: bool = False  # requests arrive over HTTP (the serve policy, pipeline.scheduling.policy), not from files
    # the stages' threads add up to more than the node's cores (RunPlan.turns): they take turns with all of
    # them, so a slot's decode rows are never split over passes (they would only contend)
    turns: bool = False

    @property
    def look_ahead(self) -> int:
        return self.window or max(64, 4 * self.max_rows)

    @property
    def scoring_cap(self) -> int:
        return self.scoring_tokens or self.prefill_tokens
