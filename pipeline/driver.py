"""Rank 0's side: stream request lines, validate and tokenize them, and decide what runs.

The driver turns each prompt of a request into a scheduler :class:`Group` (``best_of`` rows),
keeps the scheduler's queue filled from the input stream (never the whole file in memory), and
builds each pass's header and input token ids. Lines that cannot run become error records,
passed along to the writer in their input position.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from tasks.files import input_fingerprint  # noqa: F401  (re-exported: rank 0 sends it with OpenFile)
from tasks.shards import share_of
from tasks.requests import Request, RequestError, parse_line
from tasks.results import output_line

from .messages import Admission, ErrorLine, Fork, PassHeader, Prefill, Reply
from .prefix import block_digests
from .schedule import Group, Pass, Scheduler


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
                 truncate_prompts: bool = False, data_rank: int = 0, data_size: int = 1):
        self.tok, self.vocab_size, self.max_positions = tokenizer, vocab_size, max_positions
        self.sched, self.truncate = scheduler, truncate_prompts
        self.prefix = scheduler.prefix  # PrefixCache or None
        self.digests: dict[int, list[bytes]] = {}  # gid -> its prompt's block digests (prefix cache on)
        self.data_rank, self.data_size = data_rank, data_size
        self.lines: Iterator[tuple[int, bytes]] | None = None
        self.errors: list[ErrorLine] = []  # (index, output line) not yet sent to the writer
        self.metas: dict[int, Admission] = {}  # gid -> what the last rank needs when the group enters
        self.last_token: dict[int, dict[int, int]] = {}  # slot -> row -> token to feed next
        self.next_gid = 0
        self.requests_read = 0
        self.error_kinds: dict[str, int] = {}
        self.encode_seconds = 0.0

    def start(self, lines: Iterator[tuple[int, bytes]]) -> None:
        """A new file: read from ``lines``, with this file's counters from zero."""
        self.lines = lines
        self.requests_read, self.error_kinds, self.encode_seconds = 0, {}, 0.0

    # -- input ------------------------------------------------------------------------------
    def fill(self) -> None:
        """Read lines until the scheduler has a full look-ahead window (or the input ends)."""
        while self.lines is not None and len(self.sched.queue) < self.sched.window:
            item = next(self.lines, None)
            if item is None:
                self.lines = None
                return
            index, line = item
            if share_of(index, self.data_size) != self.data_rank:
                continue  # another data-parallel pipeline answers this line
            self.requests_read += 1
            req = None
            try:
                req = parse_line(line, index)
                groups = self._groups(req)
            except RequestError as e:
                raw = req.raw if req is not None else e.raw
                custom = raw.get("custom_id") if isinstance(raw, dict) and "body" in raw else None
                self.errors.append((index, output_line(raw, custom, error=e.to_dict())))
                self.error_kinds[e.reason] = self.error_kinds.get(e.reason, 0) + 1
                continue
            for g in groups:
                self.sched.submit(g)

    @property
    def exhausted(self) -> bool:
        return self.lines is None

    def _tokenize(self, req: Request, prompt) -> list[int]:
        t0 = time.perf_counter()
        try:
            return self._encode(req, prompt)
        finally:
            self.encode_seconds += time.perf_counter() - t0

    def _encode(self, req: Request, prompt) -> list[int]:
        if req.kind == "chat":
            if not getattr(self.tok, "chat_template", None):
                raise RequestError("this model's tokenizer has no chat template; send /v1/completions requests", "messages")
            ids = self.tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            return list(ids)
        if isinstance(prompt, str):
            ids = self.tok(prompt, add_special_tokens=True)["input_ids"]
            if not ids:  # empty prompt: start from BOS, or EOS for GPT-2 style tokenizers
                start = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id
                ids = [start]
            return list(ids)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", "prompt")
        return prompt

    def submit_live(self, req: Request) -> list[int]:
        """Serve mode: an HTTP request's groups go ahead of queued batch lines; returns their gids.
        Raises :class:`RequestError` when it cannot run (context window, vocabulary, budget)."""
        groups = self._groups(req, live=True)
        for g in groups:
            self.sched.submit(g)
        return [g.gid for g in groups]

    def _groups(self, req: Request, live: bool = False) -> list[Group]:
        p = req.params
        groups, metas = [], []
        for i, prompt in enumerate(req.prompts):
            ids = self._tokenize(req, prompt)
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
            digests = block_digests(ids, self.prefix.block_size) if self.prefix is not None else []
            g = Group(self.next_gid + i, len(ids), p.max_tokens, p.best_of, digests[0] if digests else None,
                      priority=live)
            if not self.sched.fits(g):
                raise RequestError(
                    f"this prompt needs {g.need * g.width} KV-cache tokens ((prompt {g.prompt_len} + max_tokens "
                    f"{g.max_tokens}) x best_of {g.width}), more than --budget {self.sched.budget}; raise --budget",
                    "max_tokens", reason="budget")
            meta = Admission(g.gid, req.index, i, len(req.prompts), ids, p, req.kind, req.custom_id,
                             note, rows=[], raw=req.raw if i == 0 else None, live=live,
                             stream=req.stream)
            groups.append(g)
            metas.append((meta, digests))
        self.next_gid += len(req.prompts)
        for g, (m, digests) in zip(groups, metas):  # nothing is kept for a request that cannot run
            self.metas[g.gid] = m
            if digests:
                self.digests[g.gid] = digests
                self.prefix.queued(digests)
        return groups

    def unqueue(self, gid: int) -> Admission | None:
        """Forget a queued group that will not run (serve mode: its client left, or shutdown)."""
        digests = self.digests.pop(gid, None)
        if digests and self.prefix is not None:
            self.prefix.unqueued(digests)
        return self.metas.pop(gid, None)

    # -- passes -----------------------------------------------------------------------------
    def build(self, ps: Pass, release: list[int]) -> tuple[PassHeader, torch.Tensor | None, torch.Tensor | None]:
        """Header + input ids for a pass: decode ids (rows, 1) and right-padded prefill ids (b, t)."""
        slot = self.sched.slots[ps.slot]
        feed = self.last_token.setdefault(ps.slot, {})
        layout = decode_layout(ps.decode_rows, slot.rows) if ps.decode_rows else []
        hdr = PassHeader(ps.slot, slot.rows, list(ps.alloc) if ps.alloc else None, release, ps.decode_rows, layout,
                         [ps.decode_start[r] for r in layout], errors=self.take_errors())
        decode_ids = torch.tensor([[feed.get(r, 0)] for r in layout], dtype=torch.long) if layout else None
        prefill_ids = None
        if ps.prefill:
            prompts = [self.metas[gid].prompt_ids for gid, _ in ps.prefill]
            hdr.prefill = [Prefill(gid, row, len(p)) for (gid, row), p in zip(ps.prefill, prompts)]
            if self.prefix is not None:
                pinned: set[int] = set()
                saving: set[int] = set()
                for item, ids in zip(hdr.prefill, prompts):
                    room = self.sched.budget - self.sched.used
                    item.cached, item.load, item.save = self.prefix.plan(ids, self.digests.pop(item.gid, []), room,
                                                                         pinned, saving)
                hdr.prefix_grow = self.prefix.take_grow()
            prefill_ids = torch.zeros(len(prompts), hdr.prefill_len, dtype=torch.long)
            for i, (item, ids) in enumerate(zip(hdr.prefill, prompts)):
                prefill_ids[i, : item.len - item.cached] = torch.tensor(ids[item.cached :])
            lens = {row: len(p) for (_, row), p in zip(ps.prefill, prompts)}
            hdr.forks = [Fork(lead, rows, lens[lead]) for lead, rows in ps.forks]
            for gid in ps.admitted:
                meta = self.metas.pop(gid)
                meta.rows = ps.rows_of[gid]
                hdr.admit.append(meta)
        return hdr, decode_ids, prefill_ids

    def take_errors(self) -> list[ErrorLine]:
        errors, self.errors = self.errors, []
        return errors

    def on_reply(self, reply: Reply) -> None:
        slot_feed = self.last_token.setdefault(reply.slot, {})
        for r in reply.finished:
            slot_feed.pop(r, None)
        slot_feed.update(dict(reply.feed))
        self.sched.on_reply(reply.slot, sorted(r for r, _ in reply.feed), reply.finished)


def decode_layout(decode_rows: list[int], slot_rows: int) -> list[int]:
    """Rows the decode segment computes: every row of the slot (no cache gather) unless few are live."""
    return list(range(slot_rows)) if 2 * len(decode_rows) >= slot_rows else list(decode_rows)
