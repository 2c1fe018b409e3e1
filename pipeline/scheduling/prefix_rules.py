"""The scheduler's rules for the prefix cache and scoring work, apart from its queue and slots: which
blocks chunked prompts have still to compute, when a group waits a pass to load a block instead of
computing it, how many prompt tokens a group's prefill computes, how scoring work spreads over a
pipeline's micro-batches, and which prompts do not share a pass (:class:`~pipeline.scheduling.
scheduler.Scheduler` calls these with itself; they only read it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.scheduling.batches import Group

if TYPE_CHECKING:
    from pipeline.scheduling.scheduler import Scheduler


def blocks_coming(sched: Scheduler) -> set[bytes]:
    """Digests of the blocks that prompts computed chunk by chunk have not completed yet (the block
    holding the next token to compute, and every later one)."""
    if sched.prefix is None or not sched.chunk:
        return set()
    bs, out = sched.prefix.block_size, set()
    for s in sched.slots:
        for row, done in s.prefilling.items():
            g = sched.groups.get(s.row_group[row])
            if g is not None:
                out.update(g.digests[done // bs :])
    return out


def waits_for_block(sched: Scheduler, g: Group, chosen: list[Group], coming: set[bytes]) -> bool:
    """``g``'s first block that is not resident will be computed by a group chosen for this pass or by
    a prompt being computed chunk by chunk (``coming``, :func:`blocks_coming`): ``g`` waits and then loads
    it (and, by the chain, the rest of that shared prefix) instead of computing it beside them."""
    if sched.prefix is None or (i := sched.prefix.hits(g.digests)) == len(g.digests):
        return False  # no cache, or every block resident (or none: a prompt shorter than a block)
    d = g.digests[i]
    return d in coming or any(i < len(c.digests) and c.digests[i] == d for c in chosen)


def prompt_work(sched: Scheduler, g: Group) -> int:
    """Prompt tokens the group's prefill computes: all but its leading resident blocks."""
    if sched.prefix is None:
        return g.prompt_len
    hits = sched.prefix.hits(g.digests) * sched.prefix.block_size
    return g.prompt_len - min(hits, g.prompt_len - 1)


def scoring_share(sched: Scheduler, window: list[Group]) -> int | None:
    """File mode, several micro-batches: the prompt tokens of scoring-only groups (max_tokens 0) a
    new slot may compute: half an even share of the window's scoring work (a prompt counts only
    what an earlier one does not compute), so it spreads over 2+ passes per slot and the stages
    work at once, instead of one slot taking 22 of 24 multiple-choice contexts while the others
    wait for its blocks. Generating groups are not limited here (fewer rows: slower decode steps)."""
    if not sched.policy.even_tail(sched):
        return None
    total, seen = 0, set()
    bs = sched.prefix.block_size if sched.prefix is not None else 0
    for g in window:
        if g.max_tokens:
            continue
        shared = 0
        for d in g.digests:
            if d not in seen and not sched.prefix.resident(d):
                break
            shared += 1
        seen.update(g.digests)
        total += g.prompt_len - min(shared * bs, g.prompt_len - 1)
    return -(-total // (2 * len(sched.slots)))


def uneven_prefill(sched: Scheduler, g: Group, chosen: list[Group]) -> bool:
    """With the prefix cache, ``g`` would make this pass's prefill pad: a pass computes every new
    prompt to the longest one's length, so a prompt resuming after cached blocks (a few tokens
    left) and one computed from the start (hundreds) do not share a pass; similar ones do."""
    if sched.prefix is None or not chosen:
        return False
    works = [prompt_work(sched, x) for x in (*chosen, g)]
    if all(w == x.prompt_len for w, x in zip(works, (*chosen, g))):
        return False  # nothing cached: packing by length as without the cache
    return max(works) > 2 * min(works) + 2 * sched.prefix.block_size
