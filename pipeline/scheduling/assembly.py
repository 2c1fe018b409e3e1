"""The last step of :meth:`Scheduler.next_pass <pipeline.scheduling.scheduler.Scheduler.next_pass>`:
with the slot's groups chosen, give the new ones their rows and write the complete :class:`Pass`:
which rows decode and where, which part of each prompt it computes (chunk ends, the prefix pool's
loads and saves), forks, the rows' adapters, releases and drops. The scheduler's state moves with it
(rows taken, chunked prompts advanced), so the pass is the only account of the decision.

Scheduler internals by design: this module is the scheduler's, split off to keep files short.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.scheduling.batches import Group, Pass, PromptPart, Slot

if TYPE_CHECKING:  # called by the scheduler with itself
    from pipeline.scheduling.scheduler import Scheduler


def assemble(sched: Scheduler, slot: Slot, alloc: tuple[int, int] | None, new: list[Group],
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
    free = slot.free_rows()
    for g in new:
        rows, free = free[: g.width], free[g.width :]
        for r in rows:
            slot.row_group[r], slot.row_len[r] = g.gid, g.prompt_len
        sched.groups[g.gid] = g
        prompts.append((g, rows[0]))
        if len(rows) > 1:
            forks.append((rows[0], tuple(rows[1:]), g.prompt_len))
        admitted.append((g.gid, tuple(rows)))
    prompts += [(sched.groups[slot.row_group[r]], r) for r in resume]
    if not decode_rows and not prompts:
        return None
    slot.fed.append(decode_rows)
    slot.decoding -= fed
    # a dense decode segment writes column 0 of its idle rows: not beside a prompt's earlier chunks
    # (those of earlier passes), nor beside rows decoding in another pass of the slot
    split = parts > 1 and bool(decode_rows)
    layout = decode_layout(decode_rows, slot.rows, not slot.prefilling and not split) if decode_rows else []
    planned = plan_prompts(sched, slot, prompts, resume)
    grow = sched.prefix.take_grow() if prompts and sched.prefix is not None else None
    if alloc:
        slot.adapters = [0] * slot.rows
    for g in new:
        for r in dict(admitted)[g.gid]:
            slot.adapters[r] = g.adapter
    drop, release = tuple(sorted(slot.drops)), tuple(sched.released)
    slot.drops.clear()
    sched.released.clear()
    return Pass(slot.sid, slot.rows, alloc, release, tuple(decode_rows), tuple(layout),
                tuple(column.get(r, 0) for r in layout), tuple(planned), tuple(forks), tuple(admitted), grow,
                tuple(slot.adapters) if any(slot.adapters) else (), drop, split)


def plan_prompts(sched: Scheduler, slot: Slot, prompts: list[tuple[Group, int]],
                 resume: dict[int, int]) -> list[PromptPart]:
    """Each prompt's part in this pass, in order: where it starts (prefix pool hits, or where its last
    chunk ended), where it ends (``chunk`` tokens on for a chunkable prompt), the pool blocks it loads
    and those it saves; the slot records how far each chunked prompt got."""
    prefix, pinned, saving, out = sched.prefix, set(), set(), []
    for g, row in prompts:
        room = sched.budget - sched.used
        cached, load, save, resumed = 0, [], [], row in resume
        if resumed:  # the rest of a chunked prompt: its earlier tokens are in the cache
            cached = resume[row]
        elif prefix is not None:
            cached, load, save, sched.shared[g.gid] = prefix.plan(
                g.prompt_len, g.digests, room, pinned, saving, sched.chunk if g.chunkable else 0)
        end = chunk_end(sched.chunk, g, cached)
        if resumed and prefix is not None:  # the shared blocks this chunk completes
            save = prefix.plan_chunk(g.digests, cached, end, sched.shared.get(g.gid, 0), room, pinned, saving)
        if end < g.prompt_len:  # the rest follows in the slot's next passes
            slot.prefilling[row] = end
        else:  # all of it computed: the row samples its first token and decodes
            slot.prefilling.pop(row, None)
            sched.shared.pop(g.gid, None)
        out.append(PromptPart(g.gid, row, end, g.prompt_len, cached, tuple(load), tuple(tuple(s) for s in save),
                              ends=not g.max_tokens and g.width == 1, resumed=resumed))
    return out


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
