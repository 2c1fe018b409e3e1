"""The last rank's work for one request file: the ordered writer, progress, and the run summary.

:meth:`OutputFile.open` resumes or starts the journal (or reports the output complete), results
go in with :meth:`put` in any order, :meth:`flush` writes what is contiguous after each pass, and
:meth:`close` publishes the output and writes ``<output>.summary.json`` (with data parallelism,
``<output>.summary-<d>-of-<D>.json``, and the last share to finish merges the journals).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

from comm.faults import MIDGEN

from .files import write_atomic
from .writer import OrderedWriter, try_merge_shares


@dataclass
class FileStats:
    """What rank 0 knows about the file when it closes it."""

    requests: int
    error_kinds: dict[str, int]
    encode_seconds: float
    padding_waste: float


@dataclass
class FileSummary:
    """The figures of one file (one data group's share), written to ``<output>.summary.json``."""

    output: str
    requests: int
    errors: int
    answered: int
    error_kinds: dict[str, int]
    prompt_tokens: int
    completion_tokens: int
    wall_seconds: float
    completion_tokens_per_second: float | None
    stage_busy: list[float]  # compute share of the wall time, per stage
    padding_waste: float  # allocated KV cells never needed
    encode_seconds: float  # tokenizing on rank 0
    decode_seconds: float  # detokenizing and formatting results on the last rank
    pipeline_size: int
    data_group_size: int
    data_rank: int
    last_rank_peak_rss_mb: float
    cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    prefix_hit_rate: float = 0.0  # cached_prompt_tokens / prompt_tokens
    kv_cells_peak: int = 0  # most KV-cache token positions a stage held (micro-batches + prefix pool)


def summary_path(output, data_rank: int, data_size: int) -> str:
    suffix = ".summary.json" if data_size == 1 else f".summary-{data_rank}-of-{data_size}.json"
    return str(output) + suffix


class OutputFile:
    def __init__(self, output: str, fingerprint: dict, data_rank: int = 0, data_size: int = 1):
        self.writer = OrderedWriter(output, fingerprint, data_rank, data_size)
        self.data_rank, self.data_size = data_rank, data_size
        self.errors = 0  # error lines written
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.progress = None
        self.t0 = time.perf_counter()

    def open(self, total: int, overwrite: bool, show_progress: bool) -> int | None:
        """This share's lines already journaled, or None when the output is complete (skip the file)."""
        skip = self.writer.open(overwrite)
        if skip is not None and show_progress:
            from .progress import Progress

            share_total = len(range(self.data_rank, total, self.data_size))
            self.progress = Progress(str(self.writer.output), share_total, skip)
        return skip

    def put(self, index: int, line: dict, error: bool = False) -> None:
        self.writer.put(index, line)
        self.errors += error

    def flush(self, generated_tokens: int) -> None:
        """Journal what is contiguous; update the progress display."""
        done = self.writer.flush()
        MIDGEN.tick(ready=self.writer.written >= 3)
        if self.progress is not None:
            self.progress.update(done, generated_tokens)

    def close(self, total: int, stats: FileStats, busy: list[float], completion_tokens: int,
              format_seconds: float, pipeline_size: int, kv_cells_peak: int = 0) -> tuple[bool, FileSummary]:
        """Publish the output if every line of this share is in; (complete, summary)."""
        if self.progress is not None:
            self.progress.close()
        complete = self.writer.close(total)
        wall = time.perf_counter() - self.t0
        summary = FileSummary(
            str(self.writer.output), stats.requests, self.errors, stats.requests - self.errors, stats.error_kinds,
            self.prompt_tokens, completion_tokens, round(wall, 3),
            round(completion_tokens / wall, 2) if wall else None, [round(b / wall, 4) for b in busy] if wall else [],
            round(stats.padding_waste, 4), round(stats.encode_seconds, 4), round(format_seconds, 4),
            pipeline_size, self.data_size, self.data_rank, round(peak_rss_mb(), 1), self.cached_tokens,
            round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0, kv_cells_peak)
        if complete:
            text = json.dumps(dataclasses.asdict(summary), indent=1)
            write_atomic(summary_path(self.writer.output, self.data_rank, self.data_size), text)
            if self.data_size > 1:
                try_merge_shares(self.writer.output, self.data_size, total)
        return complete, summary


def peak_rss_mb() -> float:
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024
