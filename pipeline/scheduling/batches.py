"""What the scheduler (:mod:`pipeline.scheduling.scheduler`) works with: a request's prompt (:class:`Group`), a
micro-batch (:class:`Slot`), and what it decides: one trip of a micro-batch through the pipeline
(:class:`Pass`, complete and immutable) and what it learns from its answer (:class:`Outcome`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Group:
    gid: int
    prompt_len: int
    max_tokens: int
    width: int = 1  # rows: best_of candidates
    digests: tuple[bytes, ...] = ()  # the prompt's prefix-cache block digests (empty: cache off or short)
    priority: bool = False  # serve mode: interactive requests go ahead of batch lines
    chunkable: bool = False  # its prompt may be computed over several passes (--prefill-chunk)
    adapter: int = 0  # LoRA adapter of its rows (0: the base model)
    request: int | None = None  # the request's input index (serve mode: what a cancelled request drops)

    @property
    def need(self) -> int:
        """Cache columns a row of this group may fill."""
        return self.prompt_len + self.max_tokens


@dataclass
class Slot:
    """A micro-batch's state, the scheduler's own (nothing else edits it)."""

    sid: int
    rows: int = 0
    cols: int = 0
    row_group: list[int | None] = field(default_factory=list)  # gid per row, None = free
    row_len: list[int] = field(default_factory=list)  # tokens in the cache per row
    decoding: set[int] = field(default_factory=set)  # rows whose next token is known and not yet fed
    prefilling: dict[int, int] = field(default_factory=dict)  # lead row -> prompt tokens computed (chunked prefill)
    fed: deque[list[int]] = field(default_factory=deque)  # decode rows of each pass in flight, oldest first
    adapters: list[int] = field(default_factory=list)  # LoRA adapter per row (set when its group enters)
    drops: set[int] = field(default_factory=set)  # serve mode: requests to forget with the slot's next pass
    cancels: set[int] = field(default_factory=set)  # a cancelled file's lines whose rows end with the next pass

    @property
    def live_rows(self) -> int:
        """Rows holding a group."""
        return sum(g is not None for g in self.row_group)


@dataclass(frozen=True)
class PromptPart:
    """The part of a group's prompt a pass computes: tokens ``cached`` .. ``end`` - 1 of ``prompt_len``."""

    gid: int
    row: int  # the group's lead row; its cache is forked to the others
    end: int  # prompt tokens up to where this pass computes
    prompt_len: int
    cached: int = 0  # leading tokens in the cache already (prefix pool hits, or its own earlier chunks)
    load: tuple[int, ...] = ()  # prefix pool blocks holding the cached tokens, in order
    save: tuple[tuple[int, int], ...] = ()  # (block index in the prompt, pool block) to keep
    ends: bool = False  # the row ends with this pass (max_tokens 0, one row)
    resumed: bool = False  # continues a chunked prompt: ``cached`` counts its own earlier chunks

    @property
    def partial(self) -> bool:
        """More of the prompt follows in the slot's next passes (no token is sampled yet)."""
        return self.end < self.prompt_len


@dataclass(frozen=True)
class Pass:
    """One trip of a slot through the pipeline, complete: nothing about it is decided elsewhere."""

    slot: int
    rows: int  # the slot's rows
    alloc: tuple[int, int] | None  # (rows, cols) to (re)allocate before the pass
    release: tuple[int, ...]  # slots whose caches can be freed (emptied since the last pass)
    decode_rows: tuple[int, ...]  # rows whose last token is fed this pass (all other rows are idle)
    decode_layout: tuple[int, ...]  # rows the decode segment computes: every slot row, or only the live ones
    decode_start: tuple[int, ...]  # cache column of each decode_layout row's token
    prompts: tuple[PromptPart, ...] = ()  # admitted groups' prompts first, then chunked prompts resuming
    forks: tuple[tuple[int, tuple[int, ...], int], ...] = ()  # (lead row, other rows, columns to copy)
    admitted: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (gid, its rows) of each group entering
    prefix_grow: int | None = None  # the prefix pools' new capacity in blocks (0: drop them), before this pass
    adapters: tuple[int, ...] = ()  # LoRA adapter of each slot row; empty: every row is the base model
    drop: tuple[int, ...] = ()  # serve mode: requests whose client left (their rows end)
    split: bool = False  # its slot's decode rows are split over several passes in flight (Scheduler.parts)
    cancel: tuple[int, ...] = ()  # a cancelled file's lines whose rows end (answered as cancelled)

    @property
    def prefill(self) -> list[tuple[int, int]]:
        """(gid, lead row) of each prompt the pass computes."""
        return [(p.gid, p.row) for p in self.prompts]

    @property
    def resume(self) -> dict[int, int]:
        """Lead row -> prompt tokens computed by earlier passes, for the chunked prompts it continues."""
        return {p.row: p.cached for p in self.prompts if p.resumed}

    @property
    def rows_of(self) -> dict[int, tuple[int, ...]]:
        """gid -> rows of each admitted group."""
        return dict(self.admitted)

    def column(self, row: int) -> int:
        """Cache column of ``row``'s decode token (0 for a row outside the decode segment)."""
        return dict(zip(self.decode_layout, self.decode_start)).get(row, 0)


@dataclass(frozen=True)
class Outcome:
    """What the scheduler made of a pass's answer."""

    finished: tuple[int | None, ...]  # gid of each finished row (None: the row was free already)
    released: bool  # the slot emptied: its caches can be freed (sent with the next pass)
    waiting: bool = False  # groups are queued (slots without a pass in flight may take them)
