"""Rank 0: a pass whose forward raised on some stage is computed again one group at a time.

The failed pass travels on and round the ring like any other (docs/design/architecture.md), and its
:class:`~pipeline.runtime.messages.Reply` comes back with ``failed`` set. :class:`Retry` then waits for
the slot's later passes in flight (they failed too), holding every other message meanwhile, and
computes each failed pass again as one pass per group (a prompt with its best_of forks from its first
token, or a group's decoding rows at their column), each marked ``retry``. Rewriting a row's columns is
idempotent, so what the failed pass wrote before the failing stage does no harm. A group whose pass
fails alone is the culprit: its request is answered with an error. The groups' answers are merged into
the reply the driver sees; rank 0's prefix index is dropped (the failed pass's blocks are missing on
some stages).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import torch

from pipeline.runtime.messages import Fork, Message, PassHeader, Prefill, Reply

log = logging.getLogger(__name__)

Sent = tuple[PassHeader, torch.Tensor | None, torch.Tensor | None]  # a pass and its decode / prefill ids


class Retry:
    """Rank 0's record of the passes in flight, and their retry. ``launch(hdr, dec, pre)`` computes a
    pass on rank 0 and sends it down; ``receive()`` takes the next message from the ring;
    ``group_of(slot, row)`` is the group a slot row holds (the scheduler's)."""

    def __init__(self, launch: Callable[[PassHeader, torch.Tensor | None, torch.Tensor | None], None],
                 receive: Callable[[], Message], group_of: Callable[[int, int], int | None], prefix=None):
        self.launch, self.receive, self.group_of, self.prefix = launch, receive, group_of, prefix
        self.sent: dict[int, deque[Sent]] = {}  # slot -> its passes in flight, oldest first
        self.held: deque[Message] = deque()  # messages that arrived during a retry, handed out in order
        self.retried = 0  # passes computed again (one per group)
        self.culprits = 0  # groups whose forward failed alone

    def sending(self, hdr: PassHeader, dec: torch.Tensor | None, pre: torch.Tensor | None) -> None:
        """A pass goes down the pipeline (not a retry's)."""
        self.sent.setdefault(hdr.slot, deque()).append((hdr, dec, pre))

    def next(self) -> Message:
        """The next answer, a failed pass's answer replaced by its retry's."""
        msg = self.held.popleft() if self.held else self.receive()
        if isinstance(msg, _Later):
            return msg.merged
        if not isinstance(msg, Reply):
            return msg
        sent = self.sent[msg.slot].popleft()
        return msg if msg.failed is None else self._recover(sent, msg)

    def _recover(self, first: Sent, reply: Reply) -> Reply:
        slot = reply.slot
        log.warning("micro-batch %d: a stage's forward raised (%s); computing its groups again one at a time",
                    slot, reply.failed)
        failed, later = [(first, reply)], []
        for sent in self.sent.pop(slot, ()):  # sent after it: they failed too, their answers on the way
            later.append(_Later())
            failed.append((sent, self._await(slot, later[-1])))
        if self.prefix is not None:
            self.prefix.reset()  # blocks the failed passes were to write are missing on some stages
        culprits: set[int] = set()
        merged = [self._retry(sent, r, culprits) for sent, r in failed]
        for place, m in zip(later, merged[1:]):
            place.merged = m
        return merged[0]

    def _await(self, slot: int, place: Message | None = None) -> Reply:
        """Receive until the next answer for ``slot``, holding the others (``place`` takes its place)."""
        while True:
            msg = self.receive()
            if isinstance(msg, Reply) and msg.slot == slot:
                if place is not None:
                    self.held.append(place)
                return msg
            self.held.append(msg)

    def _retry(self, sent: Sent, reply: Reply, culprits: set[int]) -> Reply:
        """Each group of a failed pass in a pass of its own; their answers merged into one."""
        hdr, dec, pre = sent
        out = Reply(hdr.slot, [], list(reply.finished), list(reply.answers), reply.written, list(reply.deltas))
        for unit, d, p, gid in units(hdr, dec, pre, set(reply.finished), culprits, self.group_of):
            self.retried += 1
            self.launch(unit, d, p)
            r = self._await(hdr.slot)
            out.feed += r.feed
            out.finished += r.finished
            out.answers += r.answers
            out.written += r.written
            out.deltas += r.deltas
            if r.failed is not None:
                self.culprits += 1
                culprits.add(gid)
                log.warning("micro-batch %d: the forward fails on group %d alone (rows %s): its request is answered "
                            "with an error", hdr.slot, gid, r.finished)
        out.feed.sort()
        return out


class _Later(Reply):
    """The place of a later failed answer of the slot being retried among the held messages."""

    def __init__(self):
        super().__init__(-1, [], [])
        self.merged: Reply | None = None


def units(hdr: PassHeader, dec: torch.Tensor | None, pre: torch.Tensor | None, finished: set[int],
          culprits: set[int], group_of: Callable[[int, int], int | None]) -> list[tuple]:
    """(pass, decode ids, prefill ids, group) for each group of ``hdr``: its prompt (from its first token
    unless it continues a chunked prompt, whose earlier chunks are in the cache) with its forks, or
    its decoding rows. Rows that ``finished`` already (dropped) and groups in ``culprits`` are left out."""
    admitted = {m.gid: m for m in hdr.admit}
    out = []
    for i, p in enumerate(hdr.prefill):
        if p.gid in culprits or p.row in finished:
            continue
        if p.gid in admitted and not p.resumed:  # from its first token: pool blocks may be missing somewhere
            item = Prefill(p.gid, p.row, p.len, 0, ends=p.ends, partial=p.partial, replay=p.replay)
            ids = torch.tensor([admitted[p.gid].prompt_ids[: p.len]], dtype=torch.long)
        else:  # a chunk after the first: its earlier ones are in the cache
            item = Prefill(p.gid, p.row, p.len, p.cached, list(p.load), ends=p.ends, partial=p.partial,
                           resumed=p.resumed)
            ids = pre[i : i + 1, : p.len - p.cached]
        forks = [Fork(f.lead, list(f.rows), f.cols) for f in hdr.forks if f.lead == p.row]
        unit = PassHeader(hdr.slot, hdr.rows, None, [], [], [], [], prefill=[item], forks=forks,
                          adapters=list(hdr.adapters), retry=True)
        out.append((unit, None, ids, p.gid))
    layout = {r: k for k, r in enumerate(hdr.decode_layout)}
    by_group: dict[int, list[int]] = {}
    for r in hdr.decode_rows:
        gid = group_of(hdr.slot, r)
        if r not in finished and gid is not None and gid not in culprits:
            by_group.setdefault(gid, []).append(r)
    for gid, rows in by_group.items():
        unit = PassHeader(hdr.slot, hdr.rows, None, [], rows, rows, [hdr.decode_start[layout[r]] for r in rows],
                          adapters=list(hdr.adapters), retry=True)
        out.append((unit, dec[[layout[r] for r in rows]], None, gid))
    return out
