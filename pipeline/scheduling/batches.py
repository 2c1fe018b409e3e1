"""What the scheduler (:mod:`pipeline.scheduling.scheduler`) works with: a request's prompt (:class:`Group`), a
micro-batch (:class:`Slot`) and one trip of a micro-batch through the pipeline (:class:`Pass`)."""

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
    chunkable: bool = False  # its prompt may be computed over several passes (driver: --prefill-chunk)

    @property
    def key(self) -> bytes | None:
        """Digest of the prompt's first block: prompts sharing it share a prefix."""
        return self.digests[0] if self.digests else None

    @property
    def need(self) -> int:
        """Cache columns a row of this group may fill."""
        return self.prompt_len + self.max_tokens


@dataclass
class Slot:
    sid: int
    rows: int = 0
    cols: int = 0
    row_group: list[int | None] = field(default_factory=list)  # gid per row, None = free
    row_len: list[int] = field(default_factory=list)  # tokens in the cache per row
    decoding: set[int] = field(default_factory=set)  # rows whose next token is known and not yet fed
    prefilling: dict[int, int] = field(default_factory=dict)  # lead row -> prompt tokens computed (chunked prefill)
    fed: deque[list[int]] = field(default_factory=deque)  # decode rows of each pass in flight, oldest first

    @property
    def inflight(self) -> int:
        """Passes sent and not answered yet."""
        return len(self.fed)

    @property
    def allocated(self) -> bool:
        return self.rows > 0

    def free_rows(self) -> list[int]:
        return [r for r, g in enumerate(self.row_group) if g is None]


@dataclass
class Pass:
    """One trip of a slot through the pipeline."""

    slot: int
    alloc: tuple[int, int] | None  # (rows, cols) to (re)allocate before the pass
    decode_rows: list[int]  # rows whose last token is fed this pass (all other rows are idle)
    decode_start: list[int]  # cache column per slot row for the decode segment (0 for idle rows)
    prefill: list[tuple[int, int]]  # (gid, lead row): admitted groups, then prompts resuming (``resume``)
    forks: list[tuple[int, list[int]]]  # (lead row, other rows of the group)
    admitted: list[int]  # gids admitted in this pass
    rows_of: dict[int, list[int]]  # gid -> its rows, for admitted groups
    resume: dict[int, int] = field(default_factory=dict)  # lead row -> prompt tokens computed by earlier passes
    split: bool = False  # its slot's decode rows are split over several passes in flight (Scheduler.parts)
