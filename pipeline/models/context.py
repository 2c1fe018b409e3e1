"""A *segment* (:class:`Segment`: rows of one micro-batch that run together through a stage) and
what every layer of a stage shares for it (:class:`StageContext`, built once per segment by
:meth:`pipeline.models.decoder.StageModel.context`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.cache.kv_cache import KVCache
from pipeline.models.lora import LoraRows


@dataclass
class Segment:
    """Rows of one micro-batch that run together through a stage.

    ``rows`` (b,) index the micro-batch's cache; row r's ``t`` new tokens go to cache columns
    ``start[r] .. start[r] + t - 1`` (right padding past ``lens[r]`` is computed but never
    attended). ``kv_len`` is how many cache columns attention reads.
    """

    rows: torch.Tensor  # (b,) long
    start: torch.Tensor  # (b,) long
    t: int
    kv_len: int
    all_rows: bool = False  # rows == arange(R): read the cache without a gather
    fresh: bool = False  # every start is 0: attend to the new keys only
    prefill: bool = False  # new prompts (fresh, or resuming after tokens copied from the prefix pool)
    # Host copies, read by batch-invariant attention (one row at a time) and by the attention runs
    # over the cache (``sdpa.kv_runs``); read from the device tensors (a sync) when absent: the stage
    # engine always sets them. ``lens``: real new tokens per row (the rest is right padding).
    host_rows: list[int] | None = None
    host_start: list[int] | None = None
    lens: list[int] | None = None
    adapters: list[int] | None = None  # LoRA adapter of each row (0: the base model); None: all base
    # per row of a fresh prefill: its last tokens generated before a stop (``Prefill.replay``), which
    # batch-invariant attention computes one query at a time as decode steps; None: none anywhere
    replay: list[int] | None = None

    def host(self) -> tuple[list[int], list[int], list[int]]:
        """(rows, starts, real new tokens) per row as Python lists."""
        rows = self.host_rows if self.host_rows is not None else self.rows.tolist()
        start = self.host_start if self.host_start is not None else self.start.tolist()
        return rows, start, self.lens if self.lens is not None else [self.t] * len(rows)

    @property
    def positions(self) -> torch.Tensor:  # (b, t)
        return self.start[:, None] + torch.arange(self.t, device=self.start.device)[None, :]


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
    # run on those rows only (right padding skipped), attention row by row (``spans``...).
    real: torch.Tensor | None = None
    # attention over the cache in runs of consecutive cache rows, each reading its own longest row's
    # columns: [(first, stop, first cache row, cols)] over the segment's rows (``sdpa.kv_runs``);
    # None: one call
    runs: list[tuple[int, int, int, int]] | None = None
    # unpadded prompts attending row by row (Attention._prompt_rows, unpad.row_layout): each row's real
    # tokens [first, stop) among the segment's n; each real token's (cache row, column); each row's
    # (cache row, end of its keys, {window: (first key column, mask (1, 1 or heads, len, keys) or
    # None)}), the mask None when its keys are its own new tokens under plain causal masking
    spans: list[tuple[int, int]] | None = None
    real_cells: tuple[torch.Tensor, torch.Tensor] | None = None
    row_keys: list[tuple[int, int, dict[int, tuple[int, torch.Tensor | None]]]] | None = None
    # fresh prompts on a GPU: (variable-length kernel, int32 cumulative offsets of the rows' real
    # tokens, longest row) for one packed attention call per layer instead (``unpad.packed_layout``)
    packed: tuple | None = None
    # one query per row on a CPU: (cache row, columns read) per row as int64 tensors, for one native
    # call per layer over per-row lengths (``native.decode_attention``); masks and runs are then unused
    decode: tuple[torch.Tensor, torch.Tensor] | None = None
