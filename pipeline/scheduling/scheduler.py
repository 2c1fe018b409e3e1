"""Which sequences run in which micro-batch, under the KV-cache token budget. Pure CPU logic.

A *group* is one prompt of one request with ``width`` = best_of rows sharing one prefill (the lead
row's cache is forked to the others); a *slot* is one micro-batch, a KV cache of ``rows x cols`` on
every stage; ``--budget`` bounds the sum of ``rows x cols`` over allocated slots. A new slot is packed
with groups of similar length from a look-ahead window, and a row whose sequence finished takes a new
group at once (continuous refill). :meth:`Scheduler.next_pass` returns a complete, immutable
:class:`~pipeline.scheduling.batches.Pass`, :meth:`Scheduler.on_reply` is told its outcome, and nothing
outside edits the queue or slots (docs/design/scheduler.md).
"""

from __future__ import annotations

from collections import deque
from itertools import takewhile

from pipeline.scheduling.batches import Group, Outcome, Pass, PromptPart, Slot  # noqa: F401  (Group is imported from here across the package)
from pipeline.config.components import SchedulerConfig  # noqa: F401  (re-exported)
from pipeline.scheduling.policy import FilePolicy, ServePolicy, policy_for  # noqa: F401


class Scheduler:
    """``config``: the sizes (:class:`SchedulerConfig`); ``prefix`` (a
    :class:`~pipeline.cache.prefix.PrefixCache`): its pool counts against the budget, a slot gets one
    spare column (a prefill resuming after cached tokens pads its shorter rows into it), and two groups
    whose first block is not resident yet do not enter one pass (the second then finds it computed);
    ``policy``: :class:`FilePolicy` or :class:`ServePolicy` (default: the config's mode).

    ``prefill_tokens`` caps the prompt tokens one pass computes (:meth:`_fits_pass`; ``scoring_tokens``
    for scoring prompts alone): a new micro-batch gets rows for every group packed into it, its first pass
    admits those that fit and the rest join its free rows later. Bigger passes hold activations far beyond
    the CPU's caches (32 prompts of 500 tokens: the MLP's alone 262 MB).
    """

    def __init__(self, config: SchedulerConfig, prefix=None, policy: FilePolicy | ServePolicy | None = None):
        self.config, self.prefix = config, prefix
        self.policy = policy if policy is not None else policy_for(config)
        self.budget, self.max_rows, self.stages = config.budget, config.max_rows, config.stages
        self.prefill_tokens, self.scoring_tokens = config.prefill_tokens, config.scoring_cap
        self.chunk = config.chunk  # prompt tokens a pass computes of a chunkable group (0: all)
        self.window = config.look_ahead
        self.spare = 1 if prefix is not None else 0  # columns
        self.slots = [Slot(i) for i in range(config.num_slots)]
        self._queue: deque[Group] = deque()
        self.groups: dict[int, Group] = {}  # gid -> group, while it holds rows
        self.shared: dict[int, int] = {}  # gid -> leading blocks of a chunked prompt worth keeping (PrefixCache.plan)
        self.released: list[int] = []  # slots emptied since the last pass: their caches go with the next one
        self.padding_waste = 0  # allocated cells never needed by the groups packed into them
        self.allocated_cells = 0

    # -- what others may read ---------------------------------------------------------------
    @property
    def queue(self) -> tuple[Group, ...]:
        """The queued groups, oldest (or interactive) first; read-only."""
        return tuple(self._queue)

    @property
    def queued(self) -> int:
        """Groups waiting for rows."""
        return len(self._queue)

    @property
    def wants_more(self) -> bool:
        """The look-ahead window has room for more groups."""
        return len(self._queue) < self.window

    @property
    def running_rows(self) -> int:
        """Rows holding a group, over every micro-batch."""
        return sum(s.live_rows for s in self.slots)

    @property
    def padding_ratio(self) -> float:
        """Allocated cells never needed by the groups packed into them, over every cell allocated."""
        return self.padding_waste / max(1, self.allocated_cells)

    @property
    def empty(self) -> bool:
        """Nothing queued, no row live, no pass in flight."""
        return not self._queue and not any(s.fed or s.live_rows for s in self.slots)

    def group_of(self, sid: int, row: int) -> int | None:
        """The group slot ``sid``'s ``row`` holds (None: a free row, or past the slot's rows)."""
        groups = self.slots[sid].row_group
        return groups[row] if row < len(groups) else None

    def take_released(self) -> list[int]:
        """Slots emptied since the last pass (a file's end sends them with its close)."""
        out, self.released = self.released, []
        return out

    # -- input side -------------------------------------------------------------------------
    def fits(self, g: Group) -> bool:
        """A group can ever run (a group wider than max_rows gets a micro-batch of its own)."""
        return self.cells(g) <= self.budget

    def submit(self, g: Group) -> None:
        """Queue a group: after the other priority groups if it has priority, else at the end."""
        assert self.fits(g), "caller must reject groups larger than the budget"
        self.policy.submitted(g)
        if g.priority:
            self._queue.insert(sum(1 for _ in takewhile(lambda x: x.priority, self._queue)), g)
        else:
            self._queue.append(g)

    def cancel(self, gids: set[int], request: int) -> tuple[list[Group], list[int]]:
        """Serve mode, a client left: its queued groups leave the queue (returned), and each slot
        holding rows of ``gids`` drops ``request`` with its next pass (the slots are returned)."""
        gone = [g for g in self._queue if g.gid in gids]
        self._queue = deque(g for g in self._queue if g.gid not in gids)
        held = [s.sid for s in self.slots if gids.intersection(x for x in s.row_group if x is not None)]
        for sid in held:
            self.slots[sid].drops.add(request)
        return gone, held

    def cancel_lines(self) -> tuple[list[Group], set[int]]:
        """A request file is cancelled: its lines that have not started leave the queue (returned); the
        slots holding rows of those that did end them with their next passes (the last rank answers
        them). Returns (the groups that left, the lines in flight)."""
        started = {g.request for g in self.groups.values() if not g.priority}
        gone = [g for g in self._queue if not g.priority and g.request not in started]
        self._queue = deque(g for g in self._queue if g.priority or g.request in started)
        for s in self.slots:
            held = {self.groups[x].request for x in s.row_group if x is not None and not self.groups[x].priority}
            s.cancels |= held
        return gone, started

    def shed(self) -> list[Group]:
        """Shutdown: every queued group leaves the queue (returned, oldest first); nothing new starts."""
        gone = list(self._queue)
        self._queue.clear()
        return gone

    @property
    def used(self) -> int:
        """KV cells allocated: micro-batches and the prefix pool (what ``--budget`` bounds)."""
        return sum(s.rows * s.cols for s in self.slots) + (self.prefix.cells if self.prefix is not None else 0)

    def cells(self, g: Group) -> int:
        """KV cells the group's rows take: its columns (and the spare one) per row."""
        return (g.need + self.spare) * g.width

    def idle(self) -> bool:
        return not self._queue and not any(s.rows for s in self.slots)

    # -- building passes --------------------------------------------------------------------
    def _pack(self, available: int) -> list[Group]:
        """Groups for a new slot: the oldest queued group that need not wait for blocks being computed
        (:meth:`_waits_for_block`) plus the most similar ones that fit."""
        coming = self._blocks_coming()
        window = list(self._queue)[: self.window]
        seed = next((g for g in window if not self._waits_for_block(g, [], coming)), None)
        if seed is None:
            return []
        target = max(self.budget // len(self.slots), self.cells(seed))
        cap = min(available, target)
        if self.cells(seed) > cap:
            return []
        share = self._scoring_share(window)
        scoring = (lambda g: 0 if g.max_tokens else self._prompt_work(g)) if share is not None else (lambda g: 0)
        chosen, rows, cols, work = [seed], seed.width, seed.need + self.spare, scoring(seed)
        most = self.max_rows
        if self.policy.even_tail(self) and len(self._queue) < self.window:
            # the queue is the rest of the file: an even share of its rows for each free micro-batch, so
            # that a pipeline's last micro-batches are alike (40 prompts in 32 + 8 rows at P = 2: the
            # stages took turns on the 8-row passes)
            most = min(most, max(seed.width, -(-sum(g.width for g in self._queue) // sum(
                not s.rows for s in self.slots))))
        for g in sorted((g for g in window if g is not seed), key=lambda g: abs(g.need - seed.need)):
            new_cols = max(cols, g.need + self.spare)
            if self._waits_for_block(g, chosen, coming) or self._uneven_prefill(g, chosen):
                continue
            if scoring(g) and work + scoring(g) > share:
                continue
            if rows + g.width <= most and (rows + g.width) * new_cols <= cap:
                chosen.append(g)
                rows, cols, work = rows + g.width, new_cols, work + scoring(g)
        return chosen

    def _pass_work(self, g: Group) -> int:
        """Prompt tokens a pass computes for ``g``: its first chunk when its prompt is chunked."""
        work = self._prompt_work(g)
        return min(work, self.chunk) if self.chunk and g.chunkable else work

    def _fits_pass(self, chosen: list[Group], g: Group, held: tuple[int, int] = (0, 0), decoding: bool = False) -> bool:
        """``g`` joins this pass's prefill within its cap (rows x the longest part: the pass computes every
        new prompt to that length; ``held``: (rows, longest) of the chunked prompts it continues;
        ``decoding``: the slot has rows decoding in it); always true for the first prompt."""
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
        free = slot.row_group.count(None)
        chosen, coming = [], self._blocks_coming()
        for g in list(self._queue)[: self.window]:
            if free == 0:
                break
            if not self._fits_pass(chosen, g, held, bool(slot.decoding)):
                continue
            if limit is not None and g.max_tokens > limit:
                continue
            if (g.width <= free and g.need + self.spare <= slot.cols and not self._waits_for_block(g, chosen, coming)
                    and not self._uneven_prefill(g, chosen)):
                chosen.append(g)
                free -= g.width
        return chosen

    def _refill_limit(self, slot: Slot) -> int | None:
        """Most new tokens a group may have to join this allocated slot now (None: any): while the oldest
        queued group cannot start anywhere, the policy's limit (:meth:`FilePolicy.blocked_limit`), so that
        slots drain for it (else a long request could wait behind endless short refills, the ordered writer
        holding every later result)."""
        head = self._queue[0] if self._queue else None
        blocked = head is not None and self.cells(head) > self.budget - self.used and not any(
            s.rows and head.need + self.spare <= s.cols and head.width <= s.rows for s in self.slots)
        if not blocked:
            self.policy.unblocked()
            return None
        return self.policy.blocked_limit(self, slot)

    @property
    def slot_share(self) -> int:
        """Serve mode: the cells a new micro-batch sizes its free rows to, an even share of the budget but
        no more than the prefix pool leaves at its largest (else the pool never had room to grow)."""
        share = self.budget // len(self.slots)
        if self.prefix is not None:
            share = min(share, self.budget - self.prefix.max_blocks * self.prefix.block_size)
        return share

    def _pool_yields(self) -> None:
        """Drop the prefix pool when it stands between the free cells and what the policy wants for the
        oldest request (:meth:`FilePolicy.pool_want`, :meth:`ServePolicy.pool_want`)."""
        if self.prefix is None or not self.prefix.cells:
            return
        free, want = self.budget - self.used, self.policy.pool_want(self, self.cells(self._queue[0]))
        if want is None:
            return
        if free < want <= free + self.prefix.cells:
            self.prefix.reset()

    def next_pass(self, sid: int, ahead: bool = False) -> Pass | None:
        """The next pass for an idle slot, complete, or None when it has nothing to do now. ``ahead``: a
        second pass in flight for a slot whose pass in flight decodes no row, continuing its chunked
        prompts (nothing in it waits for the answer; docs/design/chunked-prefill.md, "Passes ahead"),
        or at the end of a file the other share of its decode rows (:meth:`parts`)."""
        slot = self.slots[sid]
        if ahead:
            parts = self.parts()
            if parts > 1 and slot.decoding and len(slot.fed) < parts:  # the other rows' share
                return self._assemble(slot, None, [], {}, parts)
            if len(slot.fed) != 1 or slot.fed[0] or slot.decoding or not slot.prefilling:
                return None
            return self._assemble(slot, None, [], self._resume(slot)[0])
        assert not slot.fed
        alloc, resume, new = None, {}, []
        if not slot.rows and self._queue:
            alloc, new = self._allocate(slot)
        elif slot.rows:
            limit = self._refill_limit(slot)
            resume, held = self._resume(slot)
            new = self._refill(slot, limit, held) if limit != 0 else []
        for g in new:
            self._queue.remove(g)
        ps = self._assemble(slot, alloc, new, resume, self.parts()) if slot.rows else None
        if ps is None:
            slot.drops.clear()  # nothing runs there: its rows are gone already
            slot.cancels.clear()
        return ps

    def _allocate(self, slot: Slot) -> tuple[tuple[int, int] | None, list[Group]]:
        """A new micro-batch for an empty slot: its shape and the groups its first pass admits (the
        others packed into it stay queued: its free rows take them in the next passes)."""
        self._pool_yields()
        new = self._pack(self.budget - self.used)
        if not new:
            return None, []
        rows, cols = sum(g.width for g in new), max(g.need for g in new) + self.spare
        rows, cols = self.policy.new_slot(self, rows, cols)
        slot.rows, slot.cols = rows, cols
        slot.row_group, slot.row_len = [None] * rows, [0] * rows
        self.allocated_cells += rows * cols
        self.padding_waste += rows * cols - sum(g.need * g.width for g in new)  # spare columns count
        return (rows, cols), self._admit(new)

    def parts(self) -> int:
        """Passes a slot's decode rows split over: 1, except at the end of a file with fewer micro-batches
        holding rows than there are stages: enough that every stage has a pass (docs/design/scheduler.md).
        Not when the stages take turns with the node's cores (``SchedulerConfig.turns``): two passes then
        contend for the same cores, and each re-reads the stage's weights."""
        active = sum(s.rows > 0 for s in self.slots)
        if not self.policy.splits_tail or self.config.turns or self._queue or not active or active >= self.stages:
            return 1
        return -(-self.stages // active)

    # -- the prefix cache's and scoring work's rules (they only read the scheduler) -----------------------
    def _blocks_coming(self) -> set[bytes]:
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

    def _waits_for_block(self, g: Group, chosen: list[Group], coming: set[bytes]) -> bool:
        """``g``'s first block that is not resident will be computed by a group chosen for this pass or by
        a prompt being computed chunk by chunk (``coming``, :meth:`_blocks_coming`): ``g`` waits and then loads
        it (and, by the chain, the rest of that shared prefix) instead of computing it beside them."""
        if self.prefix is None or (i := self.prefix.hits(g.digests)) == len(g.digests):
            return False  # no cache, or every block resident (or none: a prompt shorter than a block)
        d = g.digests[i]
        return d in coming or any(i < len(c.digests) and c.digests[i] == d for c in chosen)

    def _prompt_work(self, g: Group) -> int:
        """Prompt tokens the group's prefill computes: all but its leading resident blocks."""
        if self.prefix is None:
            return g.prompt_len
        hits = self.prefix.hits(g.digests) * self.prefix.block_size
        return g.prompt_len - min(hits, g.prompt_len - 1)

    def _scoring_share(self, window: list[Group]) -> int | None:
        """File mode, several micro-batches: the prompt tokens of scoring-only groups a new slot may
        compute, half an even share of the window's scoring work (a prompt counts only what an earlier one
        does not compute), so that the stages work at once (docs/design/scheduler.md); None: no limit."""
        if not self.policy.even_tail(self):
            return None
        total, seen = 0, set()
        bs = self.prefix.block_size if self.prefix is not None else 0
        for g in window:
            if g.max_tokens:
                continue
            shared = sum(1 for _ in takewhile(lambda d: d in seen or d in self.prefix.blocks, g.digests))
            seen.update(g.digests)
            total += g.prompt_len - min(shared * bs, g.prompt_len - 1)
        return -(-total // (2 * len(self.slots)))

    def _uneven_prefill(self, g: Group, chosen: list[Group]) -> bool:
        """With the prefix cache, ``g`` would make this pass's prefill pad: a pass computes every new
        prompt to the longest one's length, so a prompt resuming after cached blocks (a few tokens
        left) and one computed from the start (hundreds) do not share a pass; similar ones do."""
        if self.prefix is None or not chosen:
            return False
        works = [self._prompt_work(x) for x in (*chosen, g)]
        if all(w == x.prompt_len for w, x in zip(works, (*chosen, g))):
            return False  # nothing cached: packing by length as without the cache
        return max(works) > 2 * min(works) + 2 * self.prefix.block_size

    # -- the pass, complete: rows, prompts' parts, forks, adapters (the state moves with it) -------------
    def _assemble(self, slot: Slot, alloc: tuple[int, int] | None, new: list[Group],
                  resume: dict[int, int], parts: int = 1) -> Pass | None:
        """The pass: rows with a token to feed decode (with ``parts`` > 1 a share of the slot's live
        rows), ``new`` groups enter free rows, ``resume`` (lead row -> tokens computed) continues chunked
        prompts. None when it would compute nothing."""
        decode_rows = sorted(slot.decoding)
        if parts > 1:
            decode_rows = decode_rows[: -(-slot.live_rows // parts)]
        fed = set(decode_rows)
        column = {r: slot.row_len[r] for r in decode_rows}
        prompts, forks, admitted = [], [], []
        free = [r for r, g in enumerate(slot.row_group) if g is None] if new else []
        if alloc:
            slot.adapters = [0] * slot.rows
        for g in new:
            rows, free = free[: g.width], free[g.width :]
            for r in rows:
                slot.row_group[r], slot.row_len[r], slot.adapters[r] = g.gid, g.prompt_len, g.adapter
            self.groups[g.gid] = g
            prompts.append((g, rows[0]))
            if len(rows) > 1:
                forks.append((rows[0], tuple(rows[1:]), g.prompt_len))
            admitted.append((g.gid, tuple(rows)))
        prompts += [(self.groups[slot.row_group[r]], r) for r in resume]
        if not decode_rows and not prompts:
            return None
        slot.fed.append(decode_rows)
        slot.decoding -= fed
        # a dense decode segment writes column 0 of its idle rows: not beside a prompt's earlier chunks
        # (those of earlier passes), nor beside rows decoding in another pass of the slot
        split = parts > 1 and bool(decode_rows)
        layout = decode_layout(decode_rows, slot.rows, not slot.prefilling and not split) if decode_rows else []
        planned = self._plan_prompts(slot, prompts, resume)
        grow = self.prefix.take_grow() if prompts and self.prefix is not None else None
        drop, cancel, release = tuple(sorted(slot.drops)), tuple(sorted(slot.cancels)), tuple(self.released)
        slot.drops.clear()
        slot.cancels.clear()
        self.released.clear()
        return Pass(slot.sid, slot.rows, alloc, release, tuple(decode_rows), tuple(layout),
                    tuple(column.get(r, 0) for r in layout), tuple(planned), tuple(forks), tuple(admitted), grow,
                    tuple(slot.adapters) if any(slot.adapters) else (), drop, split, cancel)

    def _plan_prompts(self, slot: Slot, prompts: list[tuple[Group, int]],
                      resume: dict[int, int]) -> list[PromptPart]:
        """Each prompt's part in this pass, in order: where it starts (prefix pool hits, or where its last
        chunk ended), where it ends (``chunk`` tokens on for a chunkable prompt), the pool blocks it loads
        and those it saves; the slot records how far each chunked prompt got."""
        prefix, pinned, saving, out = self.prefix, set(), set(), []
        for g, row in prompts:
            room = self.budget - self.used
            cached, load, save, resumed = 0, [], [], row in resume
            if resumed:  # the rest of a chunked prompt: its earlier tokens are in the cache
                cached = resume[row]
            elif prefix is not None:
                cached, load, save, self.shared[g.gid] = prefix.plan(
                    g.prompt_len, g.digests, room, pinned, saving, self.chunk if g.chunkable else 0)
            end = chunk_end(self.chunk, g, cached)
            if resumed and prefix is not None:  # the shared blocks this chunk completes
                save = prefix.plan_chunk(g.digests, cached, end, self.shared.get(g.gid, 0), room, pinned, saving)
            if end < g.prompt_len:  # the rest follows in the slot's next passes
                slot.prefilling[row] = end
            else:  # all of it computed: the row samples its first token and decodes
                slot.prefilling.pop(row, None)
                self.shared.pop(g.gid, None)
            out.append(PromptPart(g.gid, row, end, g.prompt_len, cached, tuple(load), tuple(tuple(s) for s in save),
                                  ends=not g.max_tokens and g.width == 1, resumed=resumed))
        return out

    # -- results side -----------------------------------------------------------------------
    def on_reply(self, sid: int, continuing: list[int], finished: list[int]) -> Outcome:
        """The outcome of the slot's oldest pass in flight: ``continuing`` rows got a token to feed
        next; ``finished`` rows are done (their groups leave once all their rows are)."""
        slot = self.slots[sid]
        was = slot.rows > 0
        for r in slot.fed.popleft():
            slot.row_len[r] += 1  # the token fed this pass is now in the cache
        slot.decoding.update(continuing)
        gids = []
        for r in finished:
            slot.decoding.discard(r)
            slot.prefilling.pop(r, None)  # serve mode: a client left mid-prompt
            gid = slot.row_group[r]
            gids.append(gid)
            self.shared.pop(gid, None)
            slot.row_group[r] = None
            if gid is not None and gid in self.groups and gid not in slot.row_group:
                del self.groups[gid]
        if all(g is None for g in slot.row_group) and not slot.fed:
            slot.rows = slot.cols = 0
            slot.row_group, slot.row_len, slot.decoding, slot.prefilling = [], [], set(), {}
            slot.adapters = []
        released = was and not slot.rows
        if released:
            self.released.append(sid)
        return Outcome(tuple(gids), released, bool(self._queue))


def chunk_end(chunk: int, g: Group, start: int) -> int:
    """Where a pass's part of ``g``'s prompt ends when it computes from token ``start`` on: ``chunk``
    tokens at a time for a group that may be chunked (one row that generates and needs no prompt
    logprobs; see ``--prefill-chunk``), else the whole prompt."""
    if chunk and g.chunkable:
        return min(g.prompt_len, start + chunk)
    return g.prompt_len


def decode_layout(decode_rows: list[int], slot_rows: int, dense: bool = True) -> list[int]:
    """Rows the decode segment computes: every row of the slot (no cache gather) unless few are live
    or ``dense`` is false (an idle row holds keys that its column 0 must keep: a chunked prompt's)."""
    return list(range(slot_rows)) if dense and 2 * len(decode_rows) >= slot_rows else list(decode_rows)
