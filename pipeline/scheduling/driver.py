"""Rank 0's side: stream request lines, validate and tokenize them, and decide what runs.

The driver turns each prompt of a request into a scheduler :class:`Group` (``best_of`` rows),
keeps the scheduler's queue filled from the input stream (never the whole file in memory), and
builds each pass's header and input token ids. Lines that cannot run become error records,
passed along to the writer in their input position.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch

from tasks.files import input_fingerprint  # noqa: F401  (re-exported: rank 0 sends it with OpenFile)
from tasks.inflight import crash_error
from tasks.requests import Request, RequestError, parse_line
from pipeline.output.results import output_line
from tasks.shards import share_of

from pipeline.scheduling.grammars import GrammarIntake
from pipeline.scheduling.intake import as_request_error, chat_ids, few, raw_value
from pipeline.runtime.messages import Admission, ErrorLine, Fork, PassHeader, Prefill, Reply
from pipeline.cache.prefix import block_digests
from pipeline.scheduling.scheduler import Group, Pass, Scheduler


log = logging.getLogger(__name__)


def read_lines(path: str, skip: int = 0) -> Iterator[tuple[int, bytes]]:
    """(index, line) for each non-blank line, split on b"\\n" only (a JSON string may hold U+2028)."""
    index = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            if index >= skip:
                yield index, line
            index += 1


class Driver:
    def __init__(self, tokenizer, vocab_size: int, max_positions: int, scheduler: Scheduler,
                 truncate_prompts: bool = False, data_rank: int = 0, data_size: int = 1,
                 models: ModelNames | None = None, prefill_chunk: int = 0, grammars: GrammarIntake | None = None):
        self.tok, self.vocab_size, self.max_positions = tokenizer, vocab_size, max_positions
        self.chunk = prefill_chunk  # prompt tokens a pass computes per chunkable prompt (0: whole prompts)
        self.sched, self.truncate = scheduler, truncate_prompts
        self.prefix = scheduler.prefix  # PrefixCache or None
        self.data_rank, self.data_size = data_rank, data_size
        self.lines: Iterator[tuple[int, bytes]] | None = None
        self.errors: list[ErrorLine] = []  # (index, output line) not yet sent to the writer
        self.metas: dict[int, Admission] = {}  # gid -> what the last rank needs when the group enters
        self.prompts: dict[int, list[int]] = {}  # gid -> prompt ids, until its prompt is computed
        self.shared: dict[int, int] = {}  # gid -> leading blocks of a chunked prompt worth keeping (PrefixCache.plan)
        self.last_token: dict[int, dict[int, int]] = {}  # slot -> row -> token to feed next
        self.models = models  # LoRA adapters by name (None: no adapters, "model" is not read)
        self.row_adapters: dict[int, list[int]] = {}  # slot -> adapter of each row
        self.grammars = grammars  # structured outputs: each constraint compiled (bounded) before admission
        self.next_gid = 0
        self.requests_read = 0
        self.error_kinds: dict[str, int] = {}
        self.encode_seconds = 0.0
        self.suspects: set[int] = set()  # lines in flight when an earlier run crashed: each runs alone
        self.culprits: set[int] = set()  # lines alone in flight when a run crashed: answered with an error
        self.held: tuple[int, bytes] | None = None  # a suspect line read, waiting for the pipeline to empty
        self.alone = False  # a suspect is running: read nothing more until it is done

    def start(self, lines: Iterator[tuple[int, bytes]], suspects=(), culprits=()) -> None:
        """A new file: read from ``lines``, with this file's counters from zero; ``suspects`` and
        ``culprits`` come from the runs that crashed on it before (tasks.inflight)."""
        self.lines = lines
        self.requests_read, self.error_kinds, self.encode_seconds = 0, {}, 0.0
        self.suspects, self.culprits, self.held, self.alone = set(suspects), set(culprits), None, False
        if self.suspects or self.culprits:
            log.warning("an earlier run ended while computing lines %s: %s", few(self.suspects | self.culprits),
                        f"{len(self.suspects)} run again one at a time" + (
                            f", {len(self.culprits)} (alone in flight then) answered with an error"
                            if self.culprits else ""))

    # -- input ------------------------------------------------------------------------------
    def fill(self) -> None:
        """Read lines until the scheduler has a full look-ahead window (or the input ends)."""
        if self.alone or self.held:
            if not self._empty():
                return
            self.alone = False
        while self.lines is not None and len(self.sched.queue) < self.sched.window:
            item, self.held = self.held or next(self.lines, None), None
            if item is None:
                self.lines = None
                return
            index, line = item
            if share_of(index, self.data_size) != self.data_rank:
                continue  # another data-parallel pipeline answers this line
            if index in self.suspects and not self._empty():
                self.held = item  # it runs once everything before it is done
                return
            self.requests_read += 1
            if index in self.culprits:  # it was alone in flight when a process died: not run again
                err = RequestError(crash_error(index)["message"], None, "server_error", reason="crashed")
                self.error_line(index, raw_value(line), err)
                continue
            req = None
            try:
                req = parse_line(line, index)
                groups = self._groups(req, alone=index in self.suspects)
            except Exception as e:  # any failure to prepare the line is its own error, never the run's
                raw = req.raw if req is not None else e.raw if hasattr(e, "raw") else \
                    line.decode("utf-8", "replace").rstrip("\r\n")
                self.error_line(index, raw, as_request_error(e))
                continue
            for g in groups:
                self.sched.submit(g)
            if index in self.suspects:
                self.alone = True
                return

    def _empty(self) -> bool:
        """Nothing queued, no row live: a suspect line can run alone."""
        return not self.sched.queue and not any(s.inflight or any(g is not None for g in s.row_group)
                                                for s in self.sched.slots)

    def error_line(self, index: int, raw, e: RequestError) -> None:
        """Line ``index`` is answered with the error ``e`` in its place."""
        custom = raw.get("custom_id") if isinstance(raw, dict) and "body" in raw else None
        self.errors.append((index, output_line(raw, custom, error=e.to_dict())))
        self.error_kinds[e.reason] = self.error_kinds.get(e.reason, 0) + 1

    @property
    def exhausted(self) -> bool:
        return self.lines is None

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
            ids = chat_ids(tok, prompt)
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
        groups = self._groups(req, live=True, ids=ids)
        for g in groups:
            self.sched.submit(g)
        return [g.gid for g in groups]

    def _groups(self, req: Request, live: bool = False, alone: bool = False,
                ids: list[list[int]] | None = None) -> list[Group]:
        p = req.params
        bad = [t for t in p.logit_bias if t >= self.vocab_size]
        if bad:
            raise RequestError(f"'logit_bias' key '{bad[0]}' is outside the vocabulary (0..{self.vocab_size - 1})",
                               "logit_bias")
        if p.structured is not None:
            if self.grammars is None:
                raise RequestError("structured outputs are not available here", "structured_outputs")
            self.grammars.check(p.structured)
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
            digests = block_digests(ids, self.prefix.block_size, salt) if self.prefix is not None else []
            chunkable = p.max_tokens > 0 and p.best_of == 1 and not p.echo  # whole-prompt logprobs: one pass
            g = Group(self.next_gid + i, len(ids), p.max_tokens, p.best_of, tuple(digests), priority=live,
                      chunkable=chunkable)
            if not self.sched.fits(g):
                spare = " + 1 spare column for the prefix cache" if self.sched.spare else ""
                raise RequestError(
                    f"this prompt needs {self.sched.cells(g)} KV-cache tokens ((prompt {g.prompt_len} + max_tokens "
                    f"{g.max_tokens}{spare}) x best_of {g.width}), more than --budget {self.sched.budget}; "
                    "raise --budget", "max_tokens", reason="budget")
            meta = Admission(g.gid, req.index, i, len(req.prompts), ids, p, req.kind, req.custom_id,
                             note, rows=[], raw=req.raw if i == 0 else None, live=live,
                             stream=req.stream, adapter=adapter, model=model, alone=alone)
            groups.append(g)
            metas.append(meta)
        self.next_gid += len(req.prompts)
        for g, m in zip(groups, metas):  # nothing is kept for a request that cannot run
            self.metas[g.gid] = m
            self.prompts[g.gid] = m.prompt_ids
            if self.prefix is not None:
                self.prefix.queued(g.digests)
        return groups

    def unqueue(self, g: Group) -> Admission | None:
        """Forget a queued group that will not run (serve mode: its client left, or shutdown)."""
        if g.digests and self.prefix is not None:
            self.prefix.unqueued(g.digests)
        self.prompts.pop(g.gid, None)
        return self.metas.pop(g.gid, None)

    # -- passes -----------------------------------------------------------------------------
    def build(self, ps: Pass, release: list[int]) -> tuple[PassHeader, torch.Tensor | None, torch.Tensor | None]:
        """Header + input ids for a pass: decode ids (rows, 1) and right-padded prefill ids (b, t)."""
        slot = self.sched.slots[ps.slot]
        feed = self.last_token.setdefault(ps.slot, {})
        # a dense decode segment writes column 0 of its idle rows: not beside a prompt's earlier chunks,
        # nor beside rows decoding in another pass of the slot
        dense = not slot.prefilling and not ps.split
        layout = decode_layout(ps.decode_rows, slot.rows, dense) if ps.decode_rows else []
        hdr = PassHeader(ps.slot, slot.rows, list(ps.alloc) if ps.alloc else None, release, ps.decode_rows, layout,
                         [ps.decode_start[r] for r in layout], errors=self.take_errors())
        decode_ids = torch.tensor([[feed.get(r, 0)] for r in layout], dtype=torch.long) if layout else None
        prefill_ids = None
        if ps.prefill:
            prompts = [self.prompts[gid] for gid, _ in ps.prefill]
            groups = [self.sched.groups[gid] for gid, _ in ps.prefill]
            hdr.prefill = [Prefill(g.gid, row, len(p), ends=not g.max_tokens and g.width == 1)
                           for g, (_, row), p in zip(groups, ps.prefill, prompts)]
            pinned: set[int] = set()
            saving: set[int] = set()
            for item, ids, g in zip(hdr.prefill, prompts, groups):
                room = self.sched.budget - self.sched.used
                if item.row in ps.resume:  # the rest of a chunked prompt: its earlier tokens are in the cache
                    item.cached, item.resumed = ps.resume[item.row], True
                elif self.prefix is not None:
                    item.cached, item.load, item.save, self.shared[g.gid] = self.prefix.plan(
                        ids, g.digests, room, pinned, saving, self.chunk if g.chunkable else 0)
                item.len = self._chunk_end(g, item.cached)
                item.partial = item.len < len(ids)
                if item.resumed and self.prefix is not None:  # the shared blocks this chunk completes
                    item.save = self.prefix.plan_chunk(g.digests, item.cached, item.len, self.shared.get(g.gid, 0),
                                                       room, pinned, saving)
                self.sched.prefilled(ps.slot, item.row, item.len)
            if self.prefix is not None:
                hdr.prefix_grow = self.prefix.take_grow()
            prefill_ids = torch.zeros(len(prompts), hdr.prefill_len, dtype=torch.long)
            for i, (item, ids) in enumerate(zip(hdr.prefill, prompts)):
                prefill_ids[i, : item.len - item.cached] = torch.tensor(ids[item.cached : item.len])
            lens = {row: len(p) for (_, row), p in zip(ps.prefill, prompts)}
            hdr.forks = [Fork(lead, rows, lens[lead]) for lead, rows in ps.forks]
            for gid in ps.admitted:
                meta = self.metas.pop(gid)
                meta.rows = ps.rows_of[gid]
                hdr.admit.append(meta)
            for item in hdr.prefill:
                if not item.partial:
                    self.prompts.pop(item.gid, None)
                    self.shared.pop(item.gid, None)
        if self.models is not None:
            hdr.adapters = self._adapters(ps, hdr.admit, slot.rows)
        return hdr, decode_ids, prefill_ids

    def _chunk_end(self, g: Group, start: int) -> int:
        """Where this pass's part of ``g``'s prompt ends when it computes from token ``start`` on:
        ``chunk`` tokens at a time for a group that may be chunked (one row that generates and needs
        no prompt logprobs; see ``--prefill-chunk``), else the whole prompt."""
        if self.chunk and g.chunkable:
            return min(g.prompt_len, start + self.chunk)
        return g.prompt_len

    def _adapters(self, ps: Pass, admitted: list[Admission], rows: int) -> list[int]:
        """Each slot row's adapter after this pass's admissions (empty when every row is base)."""
        if ps.alloc:
            self.row_adapters[ps.slot] = [0] * rows
        per_row = self.row_adapters.setdefault(ps.slot, [0] * rows)
        for meta in admitted:
            for r in meta.rows:
                per_row[r] = meta.adapter
        return list(per_row) if any(per_row) else []

    def take_errors(self) -> list[ErrorLine]:
        errors, self.errors = self.errors, []
        return errors

    def on_reply(self, reply: Reply) -> None:
        slot_feed = self.last_token.setdefault(reply.slot, {})
        groups = self.sched.slots[reply.slot].row_group
        for r in reply.finished:
            slot_feed.pop(r, None)
            self.prompts.pop(groups[r], None)  # serve mode: a client left during a chunked prompt
            self.shared.pop(groups[r], None)
        slot_feed.update(dict(reply.feed))
        self.sched.on_reply(reply.slot, sorted(r for r, _ in reply.feed), reply.finished)


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


def decode_layout(decode_rows: list[int], slot_rows: int, dense: bool = True) -> list[int]:
    """Rows the decode segment computes: every row of the slot (no cache gather) unless few are live
    or ``dense`` is false (an idle row holds keys that its column 0 must keep: a chunked prompt's)."""
    return list(range(slot_rows)) if dense and 2 * len(decode_rows) >= slot_rows else list(decode_rows)
