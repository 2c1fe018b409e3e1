"""The last rank's work for one request file: the ordered writer, progress, and the run summary.

:meth:`OutputFile.close` writes ``<output>.summary.json`` (with ``"run"``, the fingerprint of the run
that wrote the file), then publishes the output. With data parallelism each share writes
``<output>.summary-<d>-of-<D>.json`` and the last to finish merges them (the shares' figures under
``"data_groups"``). After a resume the figures count this run's requests; ``resumed_lines`` the earlier's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from comm.faults import MIDGEN

from tasks.files import atomic_path, write_atomic
from tasks.inflight import InFlight
from tasks.shards import position_of, share_of, share_size
from tasks.status import peak_rss_bytes
from tasks.writer import OrderedWriter, record_path, try_merge_shares
from tasks.progress import Progress

log = logging.getLogger(__name__)


@dataclass
class FileStats:
    """What rank 0 knows about the file when it closes it."""

    requests: int
    error_kinds: dict[str, int]
    encode_seconds: float
    padding_waste: float
    ignored_fields: dict[str, int] = field(default_factory=dict)  # --lenient-fields: requests per field ignored


@dataclass
class FileSummary:
    """The figures of one file (one data group's share), written to ``<output>.summary.json``; the manual
    says what each counts (docs/usage/scale.md; structured-outputs.md and reasoning.md for those two)."""

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
    resumed_lines: int = 0  # lines an earlier, interrupted run had journaled (not counted above)
    cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    prefix_hit_rate: float = 0.0  # cached_prompt_tokens / prompt_tokens
    kv_cells_peak: int = 0  # most KV-cache token positions a stage held (micro-batches + prefix pool)
    stage_gpu_peak_mb: list[float] = field(default_factory=list)  # CUDA: torch.cuda.max_memory_allocated per stage
    stage_precision: list[dict] = field(default_factory=list)  # per stage: dtypes, the int8 kernel per shape
    structured: dict = field(default_factory=dict)  # only when some row was constrained
    startup_seconds: float | None = None  # the last rank's process start -> this file's start
    first_result_seconds: float | None = None  # this file's start -> its first result line
    stage_memory_mb: list[dict] = field(default_factory=list)  # per stage, MiB (pipeline.runtime.memory)
    ignored_fields: dict[str, int] = field(default_factory=dict)  # --lenient-fields: requests per field ignored
    reasoning: dict = field(default_factory=dict)  # only when some row thought


def summary_path(output, data_rank: int, data_size: int) -> str:
    suffix = ".summary.json" if data_size == 1 else f".summary-{data_rank}-of-{data_size}.json"
    return str(output) + suffix


class OutputFile:
    def __init__(self, output: str, fingerprint: dict, data_rank: int = 0, data_size: int = 1):
        self.writer = OrderedWriter(output, fingerprint, data_rank, data_size)
        self.data_rank, self.data_size = data_rank, data_size
        self.errors = 0  # error lines written
        self.structured: dict = {}  # structured outputs' figures (the last rank sets them before close)
        self.reasoning: dict = {}  # a reasoning model's figures (likewise)
        self.kinds: dict[str, int] = {}  # error lines the last rank wrote, by kind (rank 0 counts the others)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.progress = None
        self.resumed_lines = 0
        self.inflight: InFlight | None = None  # the lines being computed (tasks.inflight)
        self.suspects: list[int] = []  # from earlier runs that crashed
        self.culprits: list[int] = []
        self.t0 = time.perf_counter()
        self.started = process_age_seconds()  # how long this process had run when the file opened
        self.first_at: float | None = None  # when its first result line was put

    def open(self, total: int, overwrite: bool, show_progress: bool) -> int | None:
        """This share's lines already journaled, or None when the output is complete (skip the file)."""
        fresh = overwrite or not self.writer.journal.exists()  # no earlier run to learn from
        skip = self.writer.open(overwrite)
        self.resumed_lines = skip or 0
        if skip is not None:
            self.inflight = InFlight(self.writer.journal, self.data_rank, self.data_size)
            if fresh:
                self.inflight.path.unlink(missing_ok=True)
                self.rows_path.unlink(missing_ok=True)
            self.suspects, self.culprits = self.inflight.open(skip)
            if show_progress:
                share_total = share_size(self.data_rank, total, self.data_size)
                self.progress = Progress(str(self.writer.output), share_total, skip)
        return skip

    def put(self, index: int, line: dict, error: bool = False) -> None:
        if self.first_at is None:
            self.first_at = time.perf_counter()
        self.writer.put(index, line)
        self.errors += error

    @property
    def rows_path(self) -> Path:
        """``<journal>.rows``: the rows in flight at the last checkpoint, resumed mid-generation by the next run."""
        return self.writer.journal.with_name(self.writer.journal.name + ".rows")

    def checkpoint(self, rows: dict[int, dict]) -> None:
        """Record the rows in flight (input index -> their generated tokens, logprobs, top logprobs) and
        the lines answered but not journaled yet (they wait for an earlier line: the journal is written in
        input order), replacing the last record; a full disk loses the checkpoint, not the run."""
        record = {str(i): r for i, r in rows.items()}
        record["answered"] = {str(i): line.decode() for i, line in self.writer.pending.items()}
        try:
            with atomic_path(self.rows_path, fsync=False) as tmp:
                tmp.write_bytes(orjson.dumps(record))
        except OSError as e:
            log.warning("%s: the rows in flight were not checkpointed: %s", self.rows_path, e)

    @functools.cached_property
    def _checkpointed(self) -> dict:
        """The last checkpoint as this run found it (read once: the rows and the answered lines come from it)."""
        try:
            record = orjson.loads(self.rows_path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return {}
        return record if isinstance(record, dict) else {}

    def _pending(self, i: str) -> bool:
        """``i`` (a record's key) is one of this share's lines not journaled yet."""
        w = self.writer
        return i.isdigit() and share_of(int(i), w.shares) == w.share and position_of(int(i), w.shares) >= w.written

    def restore_answered(self) -> list[int]:
        """The lines the last checkpoint holds answered but not journaled: back in the writer (written
        once the lines before them are), counted as resumed; returns their indices, which this run does
        not compute again."""
        answered = self._checkpointed.get("answered")
        if not isinstance(answered, dict):
            return []
        kept = [int(i) for i, line in answered.items() if self._pending(i) and isinstance(line, str)
                and line.endswith("\n")]
        for i in kept:
            self.writer.pending[i] = answered[str(i)].encode()
        self.resumed_lines += len(kept)
        return sorted(kept)

    def resumed_rows(self) -> dict[int, dict]:
        """The rows of the last checkpoint whose lines are not journaled yet (nothing when none was kept)."""
        return {int(i): r for i, r in self._checkpointed.items() if self._pending(i) and isinstance(r, dict)}

    @property
    def answered(self) -> int:
        """Lines answered (journaled, or waiting for an earlier line to be written in input order)."""
        return self.writer.written + len(self.writer.pending)

    def flush(self, generated_tokens: int) -> None:
        """Journal what is contiguous; update the progress display (lines answered, in any order)."""
        self.writer.flush()
        if MIDGEN.armed:
            MIDGEN.tick(ready=self.writer.written >= 3)
        if self.progress is not None:
            self.progress.update(self.answered, generated_tokens)

    def close(self, total: int, stats: FileStats, busy: list[float], completion_tokens: int,
              format_seconds: float, pipeline_size: int, kv_cells_peak: int = 0,
              gpu_peak_mb: list[float] | None = None,
              precision: list[dict] | None = None,
              memory: list[dict] | None = None) -> tuple[bool, FileSummary]:
        """Publish the output if every line of this share is in; (complete, summary)."""
        if self.progress is not None:
            self.progress.close()
        complete = self.writer.close(total)
        if self.inflight is not None:
            self.inflight.close(complete)
        if complete:
            self.rows_path.unlink(missing_ok=True)
        wall = time.perf_counter() - self.t0
        summary = FileSummary(
            str(self.writer.output), stats.requests, self.errors, stats.requests - self.errors,
            added([stats.error_kinds, self.kinds]),
            self.prompt_tokens, completion_tokens, round(wall, 3),
            round(completion_tokens / wall, 2) if wall else None, [round(b / wall, 4) for b in busy] if wall else [],
            round(stats.padding_waste, 4), round(stats.encode_seconds, 4), round(format_seconds, 4),
            pipeline_size, self.data_size, self.data_rank, round(peak_rss_bytes() / 2**20, 1), self.resumed_lines,
            self.cached_tokens, round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0,
            kv_cells_peak, gpu_peak_mb or [], precision or [], self.structured,
            round(self.started, 3) if self.started is not None else None,
            round(self.first_at - self.t0, 3) if self.first_at is not None else None, memory or [],
            dict(stats.ignored_fields), self.reasoning)
        if complete:
            record = dict(dataclasses.asdict(summary), run=self.writer.fingerprint)
            # the record exists before the output does: a finished output always says who wrote it
            write_atomic(summary_path(self.writer.output, self.data_rank, self.data_size), json.dumps(record, indent=1))
            self.writer.publish()
            if self.data_size > 1:
                output = self.writer.output
                if try_merge_shares(output, self.data_size, total, lambda: merge_summaries(output, self.data_size)):
                    for d in range(self.data_size):
                        Path(summary_path(output, d, self.data_size)).unlink(missing_ok=True)
        return complete, summary


def merge_summaries(output, shares: int) -> None:
    """The data groups' summaries -> one ``<output>.summary.json`` (called before the merged output appears)."""
    parts = [json.loads(Path(summary_path(output, d, shares)).read_text()) for d in range(shares)]
    run = [part.pop("run", None) for part in parts][0]  # every share's record names the same run
    total = {key: sum(part[key] for part in parts)
             for key in ("requests", "errors", "answered", "prompt_tokens", "completion_tokens", "resumed_lines",
                         "cached_prompt_tokens")}
    wall = max(part["wall_seconds"] for part in parts)  # the pipelines ran side by side
    merged = {"output": str(output), **total, "error_kinds": added(part["error_kinds"] for part in parts),
              "ignored_fields": added(part.get("ignored_fields", {}) for part in parts), "wall_seconds": wall,
              "completion_tokens_per_second": round(total["completion_tokens"] / wall, 2) if wall else None,
              "pipeline_size": parts[0]["pipeline_size"], "data_group_size": shares,
              "last_rank_peak_rss_mb": max(part["last_rank_peak_rss_mb"] for part in parts),
              "prefix_hit_rate": round(total["cached_prompt_tokens"] / total["prompt_tokens"], 4)
              if total["prompt_tokens"] else 0.0,
              "kv_cells_peak": max(part["kv_cells_peak"] for part in parts),
              "reasoning": added(part.get("reasoning") or {} for part in parts),
              "data_groups": parts, "run": run}
    write_atomic(record_path(output), json.dumps(merged, indent=1))


def added(counts) -> dict:
    """Several dicts of counts summed key by key (in the order the keys first appear; zeros kept)."""
    total: Counter = Counter()
    for c in counts:
        total.update(c)
    return dict(total)


def precision_note(stage_precision: list[dict]) -> str:
    """One phrase for the summary line: ``float32``, or ``int8 weights, float32 compute, kernels:
    stage 0 dequantize, stage 1 int8`` (a stage's kernels joined with + when its shapes differ), with
    ``int8 KV cache`` after the compute dtype under --kv-cache-dtype int8."""
    if not stage_precision:
        return ""
    first = stage_precision[0]
    kv = f", {first['kv_cache']} KV cache" if "kv_cache" in first else ""
    if "kernels" not in first:
        return first["weights"] + kv
    kernels = ", ".join(f"stage {i} {'+'.join(sorted(set(p.get('kernels', {}).values()))) or '-'}"
                        for i, p in enumerate(stage_precision))
    return f"{first['weights']} weights, {first['compute_dtype']} compute{kv}, kernels: {kernels}"


def process_age_seconds() -> float | None:
    """Seconds since this process started (Linux: its start time in /proc, on the boot-time clock
    the kernel measures it with; 10 ms steps); None where that is not known."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None
