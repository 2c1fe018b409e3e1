"""What every layer of a stage shares for one segment (:class:`StageContext`), built once per segment
by :meth:`pipeline.models.decoder.StageModel.context`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import KVCache
from .lora import LoraRows


@dataclass
class StageContext:
    """What every layer of a stage shares for one segment: cache, masks, rotary tables."""

    cache: KVCache | None
    # attention window (0: full) -> bool (b, 1, t, kv) mask, or additive float (b, h, t, kv) with
    # ALiBi; absent for a plain causal layout (fresh prompts, full attention: see ``attend``); empty
    # with per-row attention, which builds its own
    masks: dict[int, torch.Tensor]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "global" / "local" -> cos, sin (b, 1, t, rd/2)
    slopes: torch.Tensor | None = None  # ALiBi head slopes (per-row attention builds its own bias)
    lora: LoraRows | None = None  # the segment's LoRA adapters per row (None: every row is base)
    # A prefill segment's real tokens as flat indices into its (b * t) positions: the layers then
    # run on those rows only (right padding skipped) and attention scatters them back to (b, t).
    real: torch.Tensor | None = None
    scatter: torch.Tensor | None = None  # the (b * t, width) buffer the layers scatter real tokens into
    # attention over the cache in runs of consecutive cache rows, each reading its own longest row's
    # columns: [(first, stop, cols)] over the segment's rows (see ``sdpa.kv_runs``); None: one call
    runs: list[tuple[int, int, int]] | None = None

    def padded(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A zeroed (rows, width) buffer for ``like``'s real tokens, shared by the segment's layers:
        each fills the same real positions, so its padding positions stay zero (zeroed once)."""
        shape = (rows, like.shape[-1])
        if self.scatter is None or self.scatter.shape != shape or self.scatter.dtype != like.dtype:
            self.scatter = like.new_zeros(shape)
        return self.scatter
