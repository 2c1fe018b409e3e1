"""Every message that crosses ranks, as a dataclass, and its one wire encoding (who sends what, and
why: docs/design/architecture.md). Error lines ride along to reach the writer in their input position.

On the wire a message is ``orjson.dumps([kind, message])``; :func:`decode` rebuilds the dataclasses
and fails on a missing or unknown field, naming it, so a mistake shows where the message is read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, get_args

import orjson

from tasks.output_file import FileSummary
from tasks.requests import Params

ErrorLine = tuple[int, dict]  # (input index, the output line with its error object)


@dataclass
class Admission:
    """A prompt of a request entering a slot (rank 0 -> last rank, unread in between)."""

    _NESTED: ClassVar[dict] = {"params": Params}

    gid: int  # group id: one prompt of one request, best_of rows
    req: int  # the request's input index
    prompt_i: int
    n_prompts: int
    prompt_ids: list[int]
    params: Params
    kind: str  # "completion" | "chat"
    custom_id: str | None
    note: str | None  # e.g. a truncation warning
    rows: list[int]  # the slot rows of its best_of candidates
    raw: Any = None  # the original request object (sent with the first prompt only)
    live: bool = False  # serve mode: an HTTP request, answered back to rank 0 (not written to a file)
    stream: bool = False  # serve mode: send its text back as it is generated
    adapter: int = 0  # LoRA adapter of its rows (0: the base model)
    model: str | None = None  # the results' "model" when it is an adapter's name
    alone: bool = False  # a suspect of an earlier crash, run with nothing else in flight (tasks.inflight)
    probe: int = 0  # a suspect of an earlier crash probed with others: its probe group (pipeline.scheduling.isolation)
    resumed: int = 0  # its row was checkpointed mid-generation: the last ``resumed`` prompt ids are its tokens so far


@dataclass
class Prefill:
    gid: int
    row: int  # the group's lead row; its cache is forked to the others
    len: int  # prompt tokens up to where this pass computes (the whole prompt unless ``partial``)
    cached: int = 0  # leading prompt tokens already in the cache (prefix pool or earlier chunks): computed from here
    load: list[int] = field(default_factory=list)  # pool blocks holding them, in order
    save: list[list[int]] = field(default_factory=list)  # [block index in the prompt, pool block] to keep
    ends: bool = False  # the row ends with this pass (max_tokens 0, one row): its keys/values are never read
    partial: bool = False  # chunked prefill: more of the prompt follows in the slot's next pass (no sampling yet)
    resumed: bool = False  # continues a chunked prompt: ``cached`` counts its own earlier chunks, not pool hits
    # its last ``replay`` tokens were generated before a stop (a row resumed mid-generation): batch-invariant
    # stages compute their queries one at a time with the keys a decode step reads, as the decode steps did
    replay: int = 0


@dataclass
class Fork:
    lead: int
    rows: list[int]
    cols: int  # cache columns to copy (the prompt)


@dataclass
class PassHeader:
    """One micro-batch's trip down the pipeline. The payload packs the decode segment (one token per
    ``decode_layout`` row) then the prefill segment (``len(prefill)`` rows x ``prefill_len``)."""

    KIND: ClassVar[str] = "pass"
    _NESTED: ClassVar[dict] = {"prefill": Prefill, "forks": Fork, "admit": Admission}
    slot: int
    rows: int  # the slot's rows
    alloc: list[int] | None  # [rows, cols]: (re)allocate the slot's cache before the pass
    release: list[int]  # slots whose caches can be freed
    decode_rows: list[int]  # live rows fed a token this pass
    decode_layout: list[int]  # rows the decode segment computes: every slot row, or only the live ones
    decode_start: list[int]  # cache column of each decode_layout row's token
    prefill: list[Prefill] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    admit: list[Admission] = field(default_factory=list)
    errors: list[ErrorLine] = field(default_factory=list)
    prefix_grow: int | None = None  # the prefix pools' new capacity in blocks (0: drop them), before this pass
    drop: list[int] = field(default_factory=list)  # serve mode: live requests whose client left
    cancel: list[int] = field(default_factory=list)  # a cancelled file's lines: their rows end, answered as cancelled
    adapters: list[int] = field(default_factory=list)  # LoRA adapter of each slot row (0: base); empty: all base
    # every --status-interval seconds rank 0 sends [] and each stage appends [busy seconds since the file
    # opened, KV cells held, peak memory MiB] after its forward (the status file, /metrics: pipeline.runtime.monitor)
    stats: list[list[float]] | None = None
    failed: str | None = None  # a stage's forward raised on this pass (or skipped it): later stages skip it too
    retry: bool = False  # rank 0 computes again one group of a pass that failed (pipeline.runtime.retry)

    @property
    def prefill_len(self) -> int:
        """Columns of the prefill segment: the longest part of a prompt not served by the prefix pool."""
        return max((p.len - p.cached for p in self.prefill), default=0)

    @property
    def keeps_cache(self) -> bool:
        """The pass needs its slot's cache: rows decode, are forked, or keep their prompt's keys for
        later (a pass of prompts that all end there, echo scoring, attends to its own keys only)."""
        return bool(self.decode_layout or self.forks or self.prefix_grow is not None
                    or any(not p.ends or p.cached or p.save for p in self.prefill))

    @property
    def dense(self) -> bool:
        """The decode segment covers every slot row (no cache gather)."""
        return len(self.decode_layout) == self.rows


@dataclass
class Allocate:
    """The next pass of ``slot`` allocates its cache of ``rows`` x ``cols`` on every stage, after
    freeing the caches of the slots that pass releases (so a stage never holds more than the budget).
    Each rank forwards it before allocating, so the ranks zero their caches at the same time."""

    KIND: ClassVar[str] = "alloc"
    slot: int
    rows: int
    cols: int
    release: list[int] = field(default_factory=list)


@dataclass
class Admitting:
    """Ahead of a pass that admits lines of the open file (P > 1): each rank forwards it at once, and
    the last rank records the lines (tasks.inflight) before any stage computes them, so that a line
    killing an earlier stage in its first pass is known to the rerun."""

    KIND: ClassVar[str] = "admitting"
    lines: list[int]  # admitted with others
    alone: list[int] = field(default_factory=list)  # suspects of an earlier crash, nothing else in flight
    probe: list[int] = field(default_factory=list)  # suspects probed together beside the others
    group: int = 0  # their probe group's number in this run


@dataclass
class Reply:
    KIND: ClassVar[str] = "reply"
    slot: int
    feed: list[tuple[int, int]]  # (row, token to feed next)
    finished: list[int]  # rows whose sequence ended
    answers: list[tuple[int, dict]] = field(default_factory=list)  # serve mode: finished live requests
    written: int = 0  # results put into the open file by this pass (serve mode counts a batch's progress)
    deltas: list[tuple] = field(default_factory=list)  # streaming: (request, choice, new text, its logprobs or None)
    stats: list[list[float]] | None = None  # the pass's per-stage figures (PassHeader.stats), back to rank 0
    failed: str | None = None  # the pass was not computed (a stage's forward raised): nothing sampled
    retry: list[list] = field(default_factory=list)  # --retry-starved: pipeline.output.answers.Taken.retries


@dataclass
class OpenFile:
    KIND: ClassVar[str] = "open"
    input: str
    output: str
    total: int  # non-blank lines in the input
    input_id: str  # size + hash of the input's start: a journal resumes only against the same input
    errors: list[ErrorLine] = field(default_factory=list)


@dataclass
class Opened:
    KIND: ClassVar[str] = "opened"
    skip: int | None  # this share's lines already journaled; None: the output is complete
    error: str | None = None
    suspects: list[int] = field(default_factory=list)  # lines in flight when an earlier run crashed: run alone
    culprits: list[int] = field(default_factory=list)  # lines alone in flight when a run crashed: error lines
    resume: list[list] = field(default_factory=list)  # [line, its generated ids] of rows checkpointed mid-generation
    answered: list[int] = field(default_factory=list)  # lines an earlier run answered, kept by its checkpoint


@dataclass
class CloseFile:
    KIND: ClassVar[str] = "close"
    total: int
    requests: int  # lines this data group read
    error_kinds: dict[str, int]
    encode_seconds: float
    padding_waste: float
    release: list[int] = field(default_factory=list)
    errors: list[ErrorLine] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)  # compute seconds of stage 0, 1, ... (appended en route)
    gpu_peak_mb: list[float] = field(default_factory=list)  # CUDA: each stage's peak allocated memory (en route)
    precision: list[dict] = field(default_factory=list)  # each stage's Stage.precision() (en route)
    memory: list[dict] = field(default_factory=list)  # each stage's Stage.memory_mb() (en route)
    ignored_fields: dict[str, int] = field(default_factory=dict)  # --lenient-fields: requests per field left aside


@dataclass
class Closed:
    KIND: ClassVar[str] = "closed"
    _NESTED: ClassVar[dict] = {"summary": FileSummary}
    complete: bool
    summary: FileSummary


@dataclass
class Release:
    """Rank 0 is idle: every stage frees the caches of these emptied slots now (no pass will carry them)."""

    KIND: ClassVar[str] = "release"
    slots: list[int]


@dataclass
class Stop:
    KIND: ClassVar[str] = "stop"
    errors: list[ErrorLine] = field(default_factory=list)


Message = PassHeader | Allocate | Admitting | Reply | OpenFile | Opened | CloseFile | Closed | Release | Stop
_KINDS: dict[str, type] = {c.KIND: c for c in get_args(Message)}


class MessageError(ValueError):
    """A message that does not match its dataclass (a bug on the sending side)."""


def encode(msg: Message) -> bytes:
    return orjson.dumps([msg.KIND, msg], option=orjson.OPT_NON_STR_KEYS)  # logit_bias has int keys


def decode(data: bytes) -> Message:
    kind, body = orjson.loads(data)
    if kind not in _KINDS:
        raise MessageError(f"unknown message kind {kind!r}")
    return build(_KINDS[kind], body)


def build(cls: type, body: dict):
    """``cls(**body)`` with nested dataclasses rebuilt; a missing or unknown field is named."""
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown, missing = set(body) - names, required - set(body)
    if unknown or missing:
        what = [f"unknown field(s) {sorted(unknown)}"] * bool(unknown) + [f"missing field(s) {sorted(missing)}"] * bool(missing)
        raise MessageError(f"{cls.__name__}: {'; '.join(what)}")
    kwargs = dict(body)
    for name, sub in getattr(cls, "_NESTED", {}).items():
        if name in kwargs:
            make = getattr(sub, "from_json", None) or (lambda x, sub=sub: build(sub, x))
            value = kwargs[name]
            kwargs[name] = [make(x) for x in value] if isinstance(value, list) else make(value)
    return cls(**kwargs)
