"""Rank 0's side: stream request lines, validate and tokenize them, and decide what runs.

Each prompt of a request becomes a scheduler :class:`Group`; the driver keeps the scheduler's queue
filled from the input stream (never the whole file in memory) and turns each pass it decides into a
header and input token ids, adding what the scheduler does not hold (prompt ids, admissions, tokens to
feed, error lines). Rank 0's loops talk to the driver only; it alone talks to the scheduler.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from itertools import islice

import torch

from tasks.inflight import crash_error
from tasks.requests import Request, constraint_param, parse_line
from tasks.protocol import CANCELLED, RequestError, output_line
from tasks.shards import share_of

from pipeline.scheduling.grammars import GrammarIntake
from pipeline.scheduling.intake import as_request_error, chat_ids, few, raw_value
from pipeline.scheduling.isolation import Isolation
from pipeline.runtime.messages import Admission, ErrorLine, Fork, PassHeader, Prefill, Reply
from pipeline.cache.prefix import block_digests
from pipeline.scheduling.scheduler import Group, Pass, PromptPart, Scheduler


log = logging.getLogger(__name__)


def read_lines(path: str, skip: int = 0) -> Iterator[tuple[int, bytes]]:
    """(index, line) for each non-blank line, split on b"\\n" only (a JSON string may hold U+2028)."""
    with open(path, "rb") as f:
        yield from islice(enumerate(line for line in f if line.strip()), skip, None)


class Driver:
    def __init__(self, tokenizer, vocab_size: int, max_positions: int, scheduler: Scheduler,
                 truncate_prompts: bool = False, data_rank: int = 0, data_size: int = 1,
                 models: ModelNames | None = None, grammars: GrammarIntake | None = None,
                 lenient_fields: bool = False):
        self.tok, self.vocab_size, self.max_positions = tokenizer, vocab_size, max_positions
        self.sched, self.truncate = scheduler, truncate_prompts
        self.prefix = scheduler.prefix  # PrefixCache or None
        self.data_rank, self.data_size = data_rank, data_size
        self.lines: Iterator[tuple[int, bytes]] | None = None
        self.errors: list[ErrorLine] = []  # (index, output line) not yet sent to the writer
        self.metas: dict[int, Admission] = {}  # gid -> what the last rank needs when the group enters
        self.prompts: dict[int, list[int]] = {}  # gid -> prompt ids, until its prompt is computed
        self.last_token: dict[int, dict[int, int]] = {}  # slot -> row -> token to feed next
        self.models = models  # LoRA adapters by name (None: no adapters, "model" is not read)
        self.grammars = grammars  # structured outputs: each constraint compiled (bounded) before admission
        self.next_gid = 0
        self.requests_read = 0
        self.error_kinds: dict[str, int] = {}
        self.lenient = lenient_fields  # --lenient-fields: unknown or unsupported fields ignored (tasks.fields)
        self.ignored_fields: dict[str, int] = {}  # this file's requests that carried each ignored field
        self.encode_seconds = 0.0
        self.isolation = Isolation()  # an earlier crash's suspects, probed in halves (pipeline.scheduling.isolation)
        self.resume: dict[int, list[int]] = {}  # line -> its tokens generated before a stop or crash
        self.unresumable: set[int] = set()  # groups in flight a checkpoint cannot keep (live, several rows or prompts, echo)

    def start(self, lines: Iterator[tuple[int, bytes]], suspects=(), culprits=(), resume=()) -> None:
        """A new file: read from ``lines``, with this file's counters from zero; ``suspects`` and
        ``culprits`` come from the runs that crashed on it before (tasks.inflight), ``resume`` ([line,
        generated ids]) from the last checkpoint of its rows in flight."""
        self.lines = lines
        self.resume = {int(i): list(ids) for i, ids in resume}
        self.requests_read, self.error_kinds, self.encode_seconds, self.ignored_fields = 0, {}, 0.0, {}
        iso = self.isolation = Isolation(suspects, culprits)
        if iso.active:
            log.warning("an earlier run ended while computing lines %s: %s", few(iso.suspects | iso.culprits),
                        (f"{len(iso.suspects)} probed in halves beside the rest of the file" if len(iso.suspects) > 1
                         else f"{len(iso.suspects)} run alone" if iso.suspects else "none run again") + (
                            f", {len(iso.culprits)} (alone in flight then) answered with an error"
                            if iso.culprits else ""))

    # -- input ------------------------------------------------------------------------------
    def fill(self) -> None:
        """Read lines until the scheduler has a full look-ahead window (or the input ends); an earlier
        crash's suspects are set aside for their probes (:class:`~pipeline.scheduling.isolation.Isolation`)."""
        iso = self.isolation
        if iso.active:
            self._probe()
        while self.lines is not None and self.sched.wants_more and not (iso.draining or iso.alone):
            item = next(self.lines, None)
            if item is None:
                self.lines = None
                if iso.active:
                    self._probe()
                return
            index, line = item
            if share_of(index, self.data_size) != self.data_rank:
                continue  # another data-parallel pipeline answers this line
            if iso.active and iso.holds(index, line):
                self._probe()
                continue
            self._read(index, line)

    def _probe(self) -> None:
        """Start the next probe group when its lines are read and none is in flight."""
        iso = self.isolation
        probe = iso.next_probe(self.lines is None, self.sched.empty)  # empty: a suspect line can run alone
        if probe is None:
            return
        lines, alone, group = probe
        gids = []
        for index, line in lines:
            gids += self._read(index, line, alone, 0 if alone else group)
        iso.started(gids, alone)

    def _read(self, index: int, line: bytes, alone: bool = False, probe: int = 0) -> list[int]:
        """One line into the scheduler (or answered with its error in its place); its groups' ids."""
        self.requests_read += 1
        if index in self.isolation.culprits:  # it was alone in flight when a process died: not run again
            err = RequestError(crash_error(index)["message"], None, "server_error", reason="crashed")
            self.error_line(index, raw_value(line), err)
            return []
        req = None
        try:
            req = parse_line(line, index, self.lenient)
            groups = self._groups(req, alone=alone, probe=probe)
            self.note_ignored(req.ignored)
        except Exception as e:  # any failure to prepare the line is its own error, never the run's
            raw = req.raw if req is not None else e.raw if hasattr(e, "raw") else \
                line.decode("utf-8", "replace").rstrip("\r\n")
            self.error_line(index, raw, as_request_error(e))
            return []
        return self._submit(groups)

    def note_ignored(self, fields: list[str]) -> None:
        """--lenient-fields: count (and the first time, log) each field a request carried that was left aside."""
        for name in fields:
            if name not in self.ignored_fields:
                log.warning("request field %r ignored (--lenient-fields): it is unknown, or not implemented with "
                            "the value given; the summary's ignored_fields counts it", name)
            self.ignored_fields[name] = self.ignored_fields.get(name, 0) + 1

    def error_line(self, index: int, raw, e: RequestError) -> None:
        """Line ``index`` is answered with the error ``e`` in its place."""
        custom = raw.get("custom_id") if isinstance(raw, dict) else None
        self.errors.append((index, output_line(raw, custom, error=e.to_dict())))
        self.error_kinds[e.reason] = self.error_kinds.get(e.reason, 0) + 1

    @property
    def exhausted(self) -> bool:
        """Every line of the file is read into the scheduler or answered (no suspect waits for its probe)."""
        return self.lines is None and not self.isolation.aside

    @property
    def done(self) -> bool:
        """The input is read and every group it made has started (nothing queued)."""
        return self.lines is None and not self.sched.queued

    def _tokenize(self, req: Request, prompt) -> list[int]:
        t0 = time.perf_counter()
        try:
            return self._encode(req, prompt)
        finally:
            self.encode_seconds += time.perf_counter() - t0

    def encode_prompts(self, req: Request, tok) -> list[list[int]]:
        """Every prompt's ids with tokenizer ``tok`` (serve mode: on a tokenizing thread, with its own copy)."""
        return [self._encode(req, prompt, tok) for prompt in req.prompts]

    def _encode(self, req: Request, prompt, tok=None) -> list[int]:
        tok = tok or self.tok
        if req.kind == "chat":
            ids = chat_ids(tok, prompt, req.template_kwargs)
            param = "messages"
        elif isinstance(prompt, str):
            try:
                ids = list(tok(prompt, add_special_tokens=True)["input_ids"])
            except Exception as e:
                raise RequestError(f"the tokenizer cannot encode this prompt ({type(e).__name__})", "prompt",
                                   reason="tokenizer") from e
            if not ids:  # empty prompt: start from BOS, or EOS for GPT-2 style tokenizers
                start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
                ids = [start]
            param = "prompt"
        else:
            ids, param = prompt, "prompt"
        # the model's embedding size bounds every id it reads or biases (the tokenizer may know fewer)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", param)
        return ids

    def submit_live(self, req: Request, ids: list[list[int]] | None = None) -> list[int]:
        """Serve mode: an HTTP request's groups go ahead of queued batch lines; returns their gids.
        ``ids``: its prompts tokenized already (off this thread). Raises :class:`RequestError` when it
        cannot run (context window, vocabulary, budget)."""
        return self._submit(self._groups(req, live=True, ids=ids))

    def _submit(self, groups: list[Group]) -> list[int]:
        """Groups into the scheduler's queue; their gids."""
        for g in groups:
            self.sched.submit(g)
        return [g.gid for g in groups]

    def _groups(self, req: Request, live: bool = False, alone: bool = False,
                ids: list[list[int]] | None = None, probe: int = 0) -> list[Group]:
        p = req.params
        bad = [t for t in p.logit_bias if t >= self.vocab_size]
        if bad:
            raise RequestError(f"'logit_bias' key '{bad[0]}' is outside the vocabulary (0..{self.vocab_size - 1})",
                               "logit_bias")
        bad = [t for t in p.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise RequestError(f"'stop_token_ids' holds {bad[0]}, outside the vocabulary (0..{self.vocab_size - 1})",
                               "stop_token_ids")
        if p.structured is not None:
            if self.grammars is None:
                raise RequestError("structured outputs are not available here", "structured_outputs")
            self.grammars.check(p.structured, constraint_param(req.raw))
        adapter, model = self.models.resolve(req.model) if self.models is not None else (0, None)
        salt = model.encode() if model else b""
        groups, metas = [], []
        encoded = ids
        for i, prompt in enumerate(req.prompts):
            ids = encoded[i] if encoded is not None else self._tokenize(req, prompt)
            note = None
            if len(ids) + p.max_tokens > self.max_positions:
                keep = self.max_positions - p.max_tokens
                if not self.truncate or keep < 1:
                    raise RequestError(
                        f"prompt of {len(ids)} tokens + max_tokens {p.max_tokens} = {len(ids) + p.max_tokens} "
                        f"tokens exceeds the model's context window of {self.max_positions} tokens; shorten the "
                        "prompt, lower max_tokens, or run with --truncate-prompts", "prompt", reason="context_window")
                note = f"prompt {i} left-truncated from {len(ids)} to {keep} tokens to fit the context window"
                ids = ids[-keep:]
            done = [] if live else self.resume.pop(req.index, [])  # checkpointed mid-generation: tokens so far
            if done and (len(req.prompts) != 1 or p.best_of != 1 or p.echo or len(done) >= p.max_tokens):
                done = []  # (only one prompt, one row, no echo resume; the last rank checkpoints only those)
            ids = ids + done  # computed as prompt, the row samples its next token where it stopped
            digests = block_digests(ids, self.prefix.block_size, salt) if self.prefix is not None else []
            chunkable = p.max_tokens > 0 and p.best_of == 1 and not p.echo  # whole-prompt logprobs: one pass
            g = Group(self.next_gid + i, len(ids), p.max_tokens - len(done), p.best_of, tuple(digests),
                      priority=live, chunkable=chunkable, adapter=adapter, request=req.index)
            if not self.sched.fits(g):
                spare = " + 1 spare column for the prefix cache" if self.sched.spare else ""
                raise RequestError(
                    f"this prompt needs {self.sched.cells(g)} KV-cache tokens ((prompt {g.prompt_len} + max_tokens "
                    f"{g.max_tokens}{spare}) x best_of {g.width}), more than --budget {self.sched.budget}; "
                    "raise --budget", "max_tokens", reason="budget")
            meta = Admission(g.gid, req.index, i, len(req.prompts), ids, p, req.kind, req.custom_id,
                             note, rows=[], raw=req.raw if i == 0 else None, live=live,
                             stream=req.stream, adapter=adapter, model=model, alone=alone, probe=probe,
                             resumed=len(done))
            groups.append(g)
            metas.append(meta)
        self.next_gid += len(req.prompts)
        for g, m in zip(groups, metas):  # nothing is kept for a request that cannot run
            self.metas[g.gid] = m
            self.prompts[g.gid] = m.prompt_ids
            if self.prefix is not None:
                self.prefix.queued(g.digests)
        return groups

    def rerun(self, req: Request, budget: int, max_tokens: int, room: int, live: bool = False) -> list[int]:
        """--retry-starved: ``req`` (whose thinking starved its answer) queued once more with thinking
        budget ``budget`` and ``max_tokens``, shrunk to what the context window and --budget allow (the
        thinking budget first: the answer keeps ``room`` tokens, never fewer than the first try's
        max_tokens in all); the same seed and index, so it draws the same random stream. Returns its gids."""
        p = req.params
        ids = [self._tokenize(req, prompt) for prompt in req.prompts]
        longest = max(len(x) for x in ids)
        fits = min(self.max_positions - longest, self.sched.budget // max(p.best_of, 1) - self.sched.spare - longest)
        max_tokens = max(p.max_tokens, min(max_tokens, fits))
        req.params = dataclasses.replace(p, max_tokens=max_tokens, thinking_budget=min(budget, max(0, max_tokens - room)),
                                         starved_retry=True)
        return self._submit(self._groups(req, live=live, ids=ids))

    def unqueue(self, g: Group) -> Admission | None:
        """Forget a queued group that will not run (serve mode: its client left, or shutdown)."""
        if g.digests and self.prefix is not None:
            self.prefix.unqueued(g.digests)
        self.prompts.pop(g.gid, None)
        return self.metas.pop(g.gid, None)

    def cancel(self, gids: set[int], request: int) -> int:
        """Serve mode, a client left: its queued groups are forgotten, its admitted rows end with their
        slots' next passes. Returns how many micro-batches hold its rows."""
        gone, held = self.sched.cancel(gids, request)
        for g in gone:
            self.unqueue(g)
        return len(held)

    def cancel_file(self) -> int:
        """The open file is cancelled: no line is read, its queued lines never start (each answered with
        the cancel error in its place), its rows in flight end with their slots' next passes (the last
        rank answers them so). Returns the lines that had started."""
        self.lines = None
        self.isolation.aside.clear()
        gone, started = self.sched.cancel_lines()
        # every group unqueued; a request's line is the one its first prompt's admission carries
        raws = {g.request: m.raw for g in gone if (m := self.unqueue(g)) is not None and m.raw is not None}
        for index in sorted({g.request for g in gone}):
            self.error_line(index, raws.get(index), CANCELLED)
        return len(started)

    def shed(self) -> list[Admission]:
        """Shutdown: nothing queued starts and no line is read; the admissions of the groups dropped."""
        metas = [self.unqueue(g) for g in self.sched.shed()]
        self.lines = None
        return [m for m in metas if m is not None]

    # -- passes -----------------------------------------------------------------------------
    def next_pass(self, sid: int, busy: bool = False) -> tuple[PassHeader, torch.Tensor | None,
                                                              torch.Tensor | None] | None:
        """Slot ``sid``'s next pass built, or None: the scheduler's decision for an idle slot or, when
        ``busy`` (a pass of it in flight), for a pass ahead of that one's answer (:meth:`Scheduler.next_pass`)."""
        ps = self.sched.next_pass(sid, ahead=busy)
        return None if ps is None else self.build(ps)

    def _replay(self, p: PromptPart) -> int:
        """Tokens at the end of a whole prompt computed in one piece that its row generated before a stop."""
        meta = self.metas.get(p.gid)
        return meta.resumed if meta is not None and not p.cached and not p.partial else 0

    def build(self, ps: Pass) -> tuple[PassHeader, torch.Tensor | None, torch.Tensor | None]:
        """Header + input ids for a pass: decode ids (rows, 1) and right-padded prefill ids (b, t)."""
        feed = self.last_token.setdefault(ps.slot, {})
        hdr = PassHeader(ps.slot, ps.rows, list(ps.alloc) if ps.alloc else None, list(ps.release),
                         list(ps.decode_rows), list(ps.decode_layout), list(ps.decode_start), errors=self.take_errors(),
                         prefix_grow=ps.prefix_grow, drop=list(ps.drop), adapters=list(ps.adapters),
                         cancel=list(ps.cancel))
        layout = ps.decode_layout
        decode_ids = torch.tensor([[feed.get(r, 0)] for r in layout], dtype=torch.long) if layout else None
        prefill_ids = None
        if ps.prompts:
            prompts = [self.prompts[p.gid] for p in ps.prompts]
            hdr.prefill = [Prefill(p.gid, p.row, p.end, p.cached, list(p.load), [list(s) for s in p.save], p.ends,
                                   p.partial, p.resumed, self._replay(p)) for p in ps.prompts]
            prefill_ids = torch.zeros(len(prompts), hdr.prefill_len, dtype=torch.long)
            for i, (item, ids) in enumerate(zip(hdr.prefill, prompts)):
                prefill_ids[i, : item.len - item.cached] = torch.tensor(ids[item.cached : item.len])
            hdr.forks = [Fork(lead, list(rows), cols) for lead, rows, cols in ps.forks]
            for gid, rows in ps.admitted:
                meta = self.metas.pop(gid)
                meta.rows = list(rows)
                hdr.admit.append(meta)
                p = meta.params
                if meta.live or meta.n_prompts != 1 or p.best_of != 1 or p.echo:
                    self.unresumable.add(gid)
            for item in hdr.prefill:
                if not item.partial:
                    self.prompts.pop(item.gid, None)
        return hdr, decode_ids, prefill_ids

    def take_errors(self) -> list[ErrorLine]:
        errors, self.errors = self.errors, []
        return errors

    def on_reply(self, reply: Reply) -> bool:
        """A pass's answer: the tokens to feed next; the scheduler is told the outcome. True when slots
        without a pass in flight may have work now: the slot emptied (its caches are released with the
        next pass, or the file's close), or groups are queued."""
        slot_feed = self.last_token.setdefault(reply.slot, {})
        for r in reply.finished:
            slot_feed.pop(r, None)
        slot_feed.update(dict(reply.feed))
        out = self.sched.on_reply(reply.slot, sorted(r for r, _ in reply.feed), reply.finished)
        for gid in out.finished:
            self.prompts.pop(gid, None)  # serve mode: a client left during a chunked prompt
            self.unresumable.discard(gid)
        if self.isolation.active and (self.isolation.finished(out.finished) or self.isolation.draining):
            self._probe()  # the probe in flight is answered (or the pipeline may be empty for a lone one)
            return True
        return out.released or out.waiting

    # -- what the loops and status read: the scheduler's (each documented there) ----------------
    @property
    def slot_ids(self) -> range:
        return range(len(self.sched.slots))

    def take_released(self) -> list[int]:
        return self.sched.take_released()

    def group_of(self, sid: int, row: int) -> int | None:
        return self.sched.group_of(sid, row)

    @property
    def padding_ratio(self) -> float:
        return self.sched.padding_ratio

    @property
    def queued(self) -> int:
        return self.sched.queued

    @property
    def running_rows(self) -> int:
        return self.sched.running_rows


class ModelNames:
    """A request's "model" -> (adapter index, adapter name): the base model's names (or none) select
    the base (0); an adapter's name selects it (1, 2, ...); anything else is an error in its place.
    A name like ``org/tiny-llama`` matches a base model folder named ``tiny-llama``."""

    def __init__(self, base: list[str], adapters: list[str]):
        self.base, self.adapters = [b for b in base if b], adapters
        self.index = {name: k + 1 for k, name in enumerate(adapters)}

    def resolve(self, model) -> tuple[int, str | None]:
        if model is None:
            return 0, None
        if not isinstance(model, str):
            raise RequestError("'model' must be a string: the base model's name or a LoRA adapter's", "model")
        if model in self.index:
            return self.index[model], model
        if model in self.base or model.rsplit("/", 1)[-1] in self.base:
            return 0, None
        raise RequestError(f"unknown model {model!r}: this run serves the base model {self.base[0]!r} and the LoRA "
                           f"adapters {', '.join(repr(a) for a in self.adapters)}", "model", reason="model")
