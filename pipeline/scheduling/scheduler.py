"""Which sequences run in which micro-batch, under the KV-cache token budget. Pure CPU logic.

A *group* is one prompt of one request with ``width`` = best_of candidate rows; its rows share
one prefill (the lead row's cache is forked to the others). A *slot* is one micro-batch: a KV
cache of ``rows x cols`` tokens on every stage. ``--budget`` bounds the sum of ``rows x cols``
over allocated slots. A new slot is packed with groups of similar length (prompt + max_tokens)
from a look-ahead window, and a slot whose rows finish takes new groups into those rows at once
(continuous refill) instead of waiting for the whole micro-batch to end.

Nothing here imports torch.distributed or runs a model (tests/unit/pipeline/scheduling/test_scheduler.py).
"""

from __future__ import annotations

from collections import deque

from pipeline.scheduling.batches import Group, Pass, Slot  # noqa: F401  (Group is imported from here across the package)


PREFILL_TOKENS = 8192  # prompt tokens a pass admits; more wait for the slot's next passes (see Scheduler)


class Scheduler:
    """``prefix`` (a :class:`~pipeline.cache.prefix.PrefixCache`): its pool counts against the budget, a
    slot gets one spare column (a prefill that resumes after cached tokens pads its shorter rows
    past their length: those writes land there), and two groups whose first block is not resident
    yet do not enter the same pass: the second waits a pass and then finds the block computed.

    ``prefill_tokens``: the prompt tokens one pass computes. A new micro-batch gets rows for every group
    packed into it, but its first pass computes only the prompts that fit rows x the longest prompt
    <= this many tokens (at least one); the rest stay queued and join its free rows in the next
    passes. A chunked prompt (``chunk``) counts its chunk, and the chunks a pass continues count
    first, oldest first (:meth:`_resume`), so that with several stages no pass is far longer than
    the others (``roles.pass_prefill_tokens``); a pass of scoring prompts alone, by ``scoring_tokens``
    (``roles.pass_scoring_tokens``). Bigger passes hold activations far beyond the CPU's caches (32
    prompts of 500 tokens: the MLP's alone 262 MB in float32); the benchmark's scoring file took
    6.2 s against 5.0 s with at most 8192 a pass.

    ``headroom`` (serve mode): a new micro-batch gets free rows sized for recent requests (the largest
    need of the last 64) within its share of the budget; a request longer than every micro-batch
    drains only the one with the fewest rows in use while the others keep taking requests.
    """

    def __init__(self, budget: int, num_slots: int, max_rows: int, window: int | None = None, prefix=None,
                 headroom: bool = False, prefill_tokens: int = PREFILL_TOKENS, chunk: int = 0,
                 scoring_tokens: int | None = None, stages: int = 1):
        self.budget, self.max_rows, self.prefix = budget, max_rows, prefix
        self.stages = stages  # pipeline stages: at the end of a file decode rows split over passes (parts)
        self.prefill_tokens = prefill_tokens  # prompt tokens one pass computes (at least one prompt's part)
        # ... when the pass holds only scoring prompts (no decoding rows, no chunks it continues)
        self.scoring_tokens = scoring_tokens or prefill_tokens
        self.chunk = chunk  # prompt tokens a pass computes of a chunkable group (driver: --prefill-chunk; 0: all)
        self.spare = 1 if prefix is not None else 0  # columns
        self.headroom = headroom
        self.recent: deque[int] = deque(maxlen=64)  # serve mode: the needs of recent groups
        self.draining: int | None = None  # serve mode: the slot left to drain for a blocked head
        self.slots = [Slot(i) for i in range(num_slots)]
        self.queue: deque[Group] = deque()
        self.window = window or max(64, 4 * max_rows)
        self.groups: dict[int, Group] = {}
        self.padding_waste = 0  # allocated cells never needed by the groups packed into them
        self.allocated_cells = 0

    # -- input side -------------------------------------------------------------------------
    def fits(self, g: Group) -> bool:
        """A group can ever run (a group wider than max_rows gets a micro-batch of its own)."""
        return self.cells(g) <= self.budget

    def submit(self, g: Group) -> None:
        """Queue a group: after the other priority groups if it has priority, else at the end."""
        assert self.fits(g), "caller must reject groups larger than the budget"
        self.recent.append(g.need)
        if not g.priority:
            self.queue.append(g)
            return
        i = 0
        while i < len(self.queue) and self.queue[i].priority:
            i += 1
        self.queue.insert(i, g)

    @property
    def used(self) -> int:
        return sum(s.rows * s.cols for s in self.slots) + (self.prefix.cells if self.prefix is not None else 0)

    def cells(self, g: Group) -> int:
        """KV cells the group's rows take: its columns (and the spare one) per row."""
        return (g.need + self.spare) * g.width

    def _coming(self) -> set[bytes]:
        """Digests of the blocks that prompts computed chunk by chunk have not completed yet (the block
        holding the next token to compute, and every later one)."""
        if self.prefix is None or not self.chunk:
            return set()
        bs, out = self.prefix.block_size, set()
        for s in self.slots:
            for row, done in s.prefilling.items():
                g = self.groups.get(s.row_group[row])
                if g is not None:
                    out.update(g.digests[done // bs :])
        return out

    def _waits(self, g: Group, chosen: list[Group], coming: set[bytes]) -> bool:
        """``g``'s first block that is not resident will be computed by a group chosen for this pass or by
        a prompt being computed chunk by chunk (``coming``, :meth:`_coming`): ``g`` waits and then loads
        it (and, by the chain, the rest of that shared prefix) instead of computing it beside them."""
        if self.prefix is None or (i := self.prefix.hits(g.digests)) == len(g.digests):
            return False  # no cache, or every block resident (or none: a prompt shorter than a block)
        d = g.digests[i]
        return d in coming or any(i < len(c.digests) and c.digests[i] == d for c in chosen)

    def _work(self, g: Group) -> int:
        """Prompt tokens the group's prefill computes: all but its leading resident blocks."""
        if self.prefix is None:
            return g.prompt_len
        hits = self.prefix.hits(g.digests) * self.prefix.block_size
        return g.prompt_len - min(hits, g.prompt_len - 1)

    def _share(self, window: list[Group]) -> int | None:
        """File mode, several micro-batches: the prompt tokens of scoring-only groups (max_tokens 0) a
        new slot may compute: half an even share of the window's scoring work (a prompt counts only
        what an earlier one does not compute), so it spreads over 2+ passes per slot and the stages
        work at once, instead of one slot taking 22 of 24 multiple-choice contexts while the others
        wait for its blocks. Generating groups are not limited here (fewer rows: slower decode steps)."""
        if len(self.slots) == 1 or self.headroom:
            return None
        total, seen = 0, set()
        bs = self.prefix.block_size if self.prefix is not None else 0
        for g in window:
            if g.max_tokens:
                continue
            shared = 0
            for d in g.digests:
                if d not in seen and not self.prefix.resident(d):
                    break
                shared += 1
            seen.update(g.digests)
            total += g.prompt_len - min(shared * bs, g.prompt_len - 1)
        return -(-total // (2 * len(self.slots)))

    def _uneven(self, g: Group, chosen: list[Group]) -> bool:
        """With the prefix cache, ``g`` would make this pass's prefill pad: a pass computes every new
        prompt to the longest one's length, so a prompt resuming after cached blocks (a few tokens
        left) and one computed from the start (hundreds) do not share a pass; similar ones do."""
        if self.prefix is None or not chosen:
            return False
        works = [self._work(x) for x in (*chosen, g)]
        if all(w == x.prompt_len for w, x in zip(works, (*chosen, g))):
            return False  # nothing cached: packing by length as without the cache
        return max(works) > 2 * min(works) + 2 * self.prefix.block_size

    def idle(self) -> bool:
        return not self.queue and not any(s.allocated for s in self.slots)

    # -- building passes --------------------------------------------------------------------
    def _pack(self, available: int) -> list[Group]:
        """Groups for a new slot: the oldest queued group that need not wait for blocks being computed
        (:meth:`_waits`) plus the most similar ones that fit."""
        coming = self._coming()
        window = list(self.queue)[: self.window]
        seed = next((g for g in window if not self._waits(g, [], coming)), None)
        if seed is None:
            return []
        target = max(self.budget // len(self.slots), self.cells(seed))
        cap = min(available, target)
        if self.cells(seed) > cap:
            return []
        share = self._share(window)
        scoring = (lambda g: 0 if g.max_tokens else self._work(g)) if share is not None else (lambda g: 0)
        chosen, rows, cols, work = [seed], seed.width, seed.need + self.spare, scoring(seed)
        most = self.max_rows
        if len(self.slots) > 1 and not self.headroom and len(self.queue) < self.window:
            # the queue is the rest of the file: an even share of its rows for each free micro-batch, so
            # that a pipeline's last micro-batches are alike (40 prompts in 32 + 8 rows at P = 2: the
            # stages took turns on the 8-row passes)
            most = min(most, max(seed.width, -(-sum(g.width for g in self.queue) // sum(
                not s.allocated for s in self.slots))))
        for g in sorted((g for g in window if g is not seed), key=lambda g: abs(g.need - seed.need)):
            new_cols = max(cols, g.need + self.spare)
            if self._waits(g, chosen, coming) or self._uneven(g, chosen):
                continue
            if scoring(g) and work + scoring(g) > share:
                continue
            if rows + g.width <= most and (rows + g.width) * new_cols <= cap:
                chosen.append(g)
                rows, cols, work = rows + g.width, new_cols, work + scoring(g)
        return chosen

    def _pass_work(self, g: Group) -> int:
        """Prompt tokens a pass computes for ``g``: its first chunk when its prompt is chunked."""
        work = self._work(g)
        return min(work, self.chunk) if self.chunk and g.chunkable else work

    def _fits_pass(self, chosen: list[Group], g: Group, held: tuple[int, int] = (0, 0), decoding: bool = False) -> bool:
        """``g`` joins this pass's prefill within its cap: the pass computes every new prompt to the
        longest one's length, so the cost is rows x the longest; ``held``: (rows, longest) of the
        chunked prompts the pass continues; ``decoding``: the slot has rows decoding in this pass. A
        pass of scoring prompts alone is capped by ``scoring_tokens``, any other by ``prefill_tokens``.
        Always true for the first prompt."""
        if not chosen and not held[0]:
            return True
        groups = (*chosen, g)
        rows = held[0] + sum(x.width for x in groups)
        scoring = not decoding and not held[0] and not any(x.max_tokens for x in groups)
        return rows * max(held[1], *(self._pass_work(x) for x in groups)) <= (
            self.scoring_tokens if scoring else self.prefill_tokens)

    def _admit(self, groups: list[Group]) -> list[Group]:
        """The leading ``groups`` that fit one pass's prefill (at least one)."""
        n = 1
        while n < len(groups) and self._fits_pass(groups[:n], groups[n]):
            n += 1
        return groups[:n]

    def _resume(self, slot: Slot) -> tuple[dict[int, int], tuple[int, int]]:
        """The chunked prompts this pass continues (row -> tokens computed), oldest first, within
        ``prefill_tokens`` (at least one), and their (rows, longest chunk) for :meth:`_fits_pass`."""
        resume, longest = {}, 0
        for row, done in slot.prefilling.items():
            left = self.groups[slot.row_group[row]].prompt_len - done
            work = min(left, self.chunk) if self.chunk else left
            if resume and (len(resume) + 1) * max(longest, work) > self.prefill_tokens:
                break
            resume[row], longest = done, max(longest, work)
        return resume, (len(resume), longest)

    def _refill(self, slot: Slot, limit: int | None = None, held: tuple[int, int] = (0, 0)) -> list[Group]:
        free = len(slot.free_rows())
        chosen, coming = [], self._coming()
        for g in list(self.queue)[: self.window]:
            if free == 0:
                break
            if not self._fits_pass(chosen, g, held, bool(slot.decoding)):
                continue
            if limit is not None and g.max_tokens > limit:
                continue
            if (g.width <= free and g.need + self.spare <= slot.cols and not self._waits(g, chosen, coming)
                    and not self._uneven(g, chosen)):
                chosen.append(g)
                free -= g.width
        return chosen

    def _head_blocked(self) -> bool:
        """The oldest queued group cannot start anywhere now: stop refilling so slots drain (else a long
        request could wait behind endless short refills, the ordered writer holding every later result)."""
        if not self.queue:
            return False
        head = self.queue[0]
        if self.cells(head) <= self.budget - self.used:
            return False
        return not any(s.allocated and head.need + self.spare <= s.cols and head.width <= s.rows for s in self.slots)

    def _refill_limit(self, slot: Slot) -> int | None:
        """Most new tokens a group may have to join this allocated slot now (None: any). While the
        oldest queued group is blocked, file mode: every slot drains for it (0); serve mode: only the
        slot with the fewest rows in use, taking groups that end before its longest row (backfill)."""
        if not self._head_blocked():
            self.draining = None
            return None
        if not self.headroom:
            return 0
        if self.draining is None or not self.slots[self.draining].allocated:
            held = [s for s in self.slots if s.allocated]
            self.draining = min(held, key=lambda s: (len(s.row_group) - len(s.free_rows()), s.sid)).sid
        if slot.sid != self.draining:
            return None
        left = [self.groups[g].need - n for g, n in zip(slot.row_group, slot.row_len) if g in self.groups]
        return max(left, default=1) - 1

    @property
    def slot_share(self) -> int:
        """Serve mode: the cells a new micro-batch sizes its free rows to, an even share of the budget,
        but no more than the prefix pool leaves at its largest (one micro-batch took the whole budget,
        and the pool never had room to grow)."""
        share = self.budget // len(self.slots)
        if self.prefix is not None:
            share = min(share, self.budget - self.prefix.max_blocks * self.prefix.block_size)
        return share

    def _pool_yields(self) -> None:
        """Drop the prefix pool when it stands between the budget and the oldest request (with no
        slot allocated) or, in serve mode, a new micro-batch's share of the budget (slots rarely all
        drain there, and a pool grown while traffic was light would keep every new slot small). The
        share (:attr:`slot_share`) leaves the pool room: with one micro-batch (P = 1) it was the whole
        budget, and the pool was dropped before every request that came alone."""
        if self.prefix is None or not self.prefix.cells:
            return
        free, want = self.budget - self.used, self.cells(self.queue[0])
        if self.headroom:
            want = max(want, self.slot_share)
        elif any(s.allocated for s in self.slots):
            return
        if free < want <= free + self.prefix.cells:
            self.prefix.reset()

    def next_pass(self, sid: int, ahead: bool = False) -> Pass | None:
        """The next pass for an idle slot, or None when it has nothing to do now. ``ahead``: a second
        pass in flight for a slot whose pass in flight decodes no row, continuing its chunked prompts
        (nothing in it waits for the answer; docs/design/chunked-prefill.md, "Passes ahead")."""
        slot = self.slots[sid]
        if ahead:
            parts = self.parts()
            if parts > 1 and slot.decoding and slot.inflight < parts:  # the other rows' share
                return self._build(slot, None, [], {}, parts)
            if slot.inflight != 1 or slot.fed[0] or slot.decoding or not slot.prefilling:
                return None
            return self._build(slot, None, [], self._resume(slot)[0])
        assert not slot.inflight
        alloc, resume = None, {}
        if not slot.allocated and self.queue:
            self._pool_yields()
            new = self._pack(self.budget - self.used)
            if new:
                rows, cols = sum(g.width for g in new), max(g.need for g in new) + self.spare
                if self.headroom:  # free rows with room for recent requests, within this slot's share
                    cap = min(self.budget - self.used, max(self.slot_share, rows * cols))
                    typical = max(self.recent, default=0)
                    cols = max(cols, min(typical + self.spare, cap // max(rows, 1)), cap // self.max_rows)
                    rows = max(rows, min(self.max_rows, cap // cols))
                slot.rows, slot.cols = rows, cols
                slot.row_group, slot.row_len = [None] * rows, [0] * rows
                alloc = (rows, cols)
                self.allocated_cells += rows * cols
                self.padding_waste += rows * cols - sum(g.need * g.width for g in new)  # spare columns count
                new = self._admit(new)  # the others stay queued: the slot's free rows take them next passes
        elif slot.allocated:
            limit = self._refill_limit(slot)
            resume, held = self._resume(slot)
            new = self._refill(slot, limit, held) if limit != 0 else []
        else:
            new = []
        for g in new:
            self.queue.remove(g)
        if not slot.allocated:
            return None
        return self._build(slot, alloc, new, resume, self.parts())

    def parts(self) -> int:
        """Passes a slot's decode rows split over: 1, except at the end of a file (file mode, nothing
        queued) with fewer micro-batches holding rows than there are stages: enough that every stage
        has a pass (one micro-batch decoding alone at P = 2 left each stage idle half the time)."""
        active = sum(s.allocated for s in self.slots)
        if self.headroom or self.queue or not active or active >= self.stages:
            return 1
        return -(-self.stages // active)

    def _build(self, slot: Slot, alloc: tuple[int, int] | None, new: list[Group], resume: dict[int, int],
               parts: int = 1) -> Pass | None:
        """The pass: rows with a token to feed decode (with ``parts`` > 1 a share of the slot's live
        rows), ``new`` groups enter free rows, ``resume`` continues chunked prompts."""
        decode_rows = sorted(slot.decoding)
        if parts > 1:
            decode_rows = decode_rows[: -(-sum(g is not None for g in slot.row_group) // parts)]
        fed = set(decode_rows)
        decode_start = [slot.row_len[r] if r in fed else 0 for r in range(slot.rows)]
        prefill, forks, rows_of = [], [], {}
        free = slot.free_rows()
        for g in new:
            rows, free = free[: g.width], free[g.width :]
            for r in rows:
                slot.row_group[r], slot.row_len[r] = g.gid, g.prompt_len
            self.groups[g.gid] = g
            prefill.append((g.gid, rows[0]))
            if len(rows) > 1:
                forks.append((rows[0], rows[1:]))
            rows_of[g.gid] = rows
        prefill += [(slot.row_group[r], r) for r in resume]
        if not decode_rows and not prefill:
            return None
        slot.fed.append(decode_rows)
        slot.decoding -= fed
        return Pass(slot.sid, alloc, decode_rows, decode_start, prefill, forks, [g.gid for g in new], rows_of, resume,
                    split=parts > 1 and bool(decode_rows))

    def prefilled(self, sid: int, row: int, done: int) -> None:
        """The pass being built computes the prompt of ``row`` up to token ``done``: the rest of the
        prompt (chunked prefill) follows in the slot's next passes; once all of it is computed the
        row samples its first token and decodes (:meth:`on_reply`)."""
        slot = self.slots[sid]
        if done < self.groups[slot.row_group[row]].prompt_len:
            slot.prefilling[row] = done
        else:
            slot.prefilling.pop(row, None)

    # -- results side -----------------------------------------------------------------------
    def on_reply(self, sid: int, continuing: list[int], finished: list[int]) -> None:
        """After a pass: ``continuing`` rows got a token to feed next; ``finished`` rows are done."""
        slot = self.slots[sid]
        for r in slot.fed.popleft():
            slot.row_len[r] += 1  # the token fed this pass is now in the cache
        slot.decoding.update(continuing)
        for r in finished:
            slot.decoding.discard(r)
            slot.prefilling.pop(r, None)  # serve mode: a client left mid-prompt
            gid = slot.row_group[r]
            slot.row_group[r] = None
            if gid is not None and gid in self.groups and all(x != gid for x in slot.row_group):
                del self.groups[gid]
        if all(g is None for g in slot.row_group) and not slot.inflight:
            slot.rows = slot.cols = 0
            slot.row_group, slot.row_len, slot.decoding, slot.prefilling = [], [], set(), {}
