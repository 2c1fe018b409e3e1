"""Rank 0's retry of a pass whose forward raised (pipeline.runtime.retry), with no processes: which
passes it builds, and how the answers come back in order."""

from __future__ import annotations

from collections import deque

import torch

from pipeline.runtime.messages import Admission, Fork, PassHeader, Prefill, Reply
from pipeline.runtime.retry import Retry, units
from tasks.requests import Params


def _admission(gid: int, req: int, ids: list[int], rows: list[int]) -> Admission:
    return Admission(gid, req, 0, 1, ids, Params(), "completion", None, None, rows)


def _pass() -> tuple[PassHeader, torch.Tensor, torch.Tensor]:
    """Slot 0 of 6 rows: rows 0, 1 decode (groups 10, 11), group 12 enters rows 2-3 (best_of 2; 3 of its
    5 prompt tokens from the prefix pool), group 13 continues a chunked prompt in row 4 (tokens 8..12)."""
    hdr = PassHeader(0, 6, None, [], [0, 1], [0, 1, 2, 3, 4, 5], [7, 9, 0, 0, 0, 0],
                     prefill=[Prefill(12, 2, 5, cached=3, load=[4], save=[[0, 5]]),
                              Prefill(13, 4, 12, cached=8, resumed=True)],
                     forks=[Fork(2, [3], 5)], admit=[_admission(12, 7, [5, 6, 7, 8, 9], [2, 3])], adapters=[])
    dec = torch.tensor([[100], [101], [0], [0], [0], [0]])
    pre = torch.tensor([[8, 9, 0, 0], [20, 21, 22, 23]])
    return hdr, dec, pre


def test_one_pass_per_group_prompts_from_their_first_token():
    hdr, dec, pre = _pass()
    got = units(hdr, dec, pre, set(), set(), lambda slot, row: {0: 10, 1: 11}.get(row))
    assert [gid for *_, gid in got] == [12, 13, 10, 11]
    (u12, d12, p12, _), (u13, d13, p13, _), (u10, d10, _, _), (u11, d11, _, _) = got
    assert all(u.retry and u.alloc is None and not u.release and not u.admit for u, *_ in got)
    # a new prompt: from token 0, no pool blocks loaded or saved, its best_of fork kept
    assert u12.prefill == [Prefill(12, 2, 5, 0)] and u12.forks == [Fork(2, [3], 5)] and d12 is None
    assert p12.tolist() == [[5, 6, 7, 8, 9]]
    # a chunk after the first: its earlier chunks are in the cache
    assert u13.prefill[0].cached == 8 and u13.prefill[0].resumed and p13.tolist() == [[20, 21, 22, 23]]
    assert u10.decode_rows == u10.decode_layout == [0] and u10.decode_start == [7] and d10.tolist() == [[100]]
    assert u11.decode_start == [9] and d11.tolist() == [[101]] and not u11.dense


def test_dropped_rows_and_culprits_are_left_out():
    hdr, dec, pre = _pass()
    got = units(hdr, dec, pre, {1}, {13}, lambda slot, row: {0: 10, 1: 11}.get(row))
    assert [gid for *_, gid in got] == [12, 10]


class Ring:
    """A fake pipeline: passes launched go into a queue; answers come back in order."""

    def __init__(self, incoming: list):
        self.incoming, self.launched = deque(incoming), []

    def launch(self, hdr, dec, pre) -> None:
        self.launched.append(hdr)
        gid = next(iter(p.gid for p in hdr.prefill), None)
        if gid == 12:  # the culprit: fails alone too
            self.incoming.append(Reply(hdr.slot, [], [2, 3], failed="boom"))
        else:
            rows = hdr.decode_rows or [p.row for p in hdr.prefill]
            self.incoming.append(Reply(hdr.slot, [(r, 50 + r) for r in rows], [], written=1))

    def receive(self):
        return self.incoming.popleft()


def test_a_failed_pass_is_answered_by_its_groups_and_other_answers_keep_their_order():
    hdr, dec, pre = _pass()
    later = PassHeader(0, 6, None, [], [], [], [], prefill=[Prefill(13, 4, 16, cached=12, resumed=True)])
    other = Reply(1, [(0, 9)], [])
    ring = Ring([Reply(0, [], [], failed="RuntimeError: x"), other, Reply(0, [], [], failed="skipped")])
    r = Retry(ring.launch, ring.receive, lambda slot, row: {0: 10, 1: 11}.get(row))
    r.sending(hdr, dec, pre)
    r.sending(PassHeader(1, 2, None, [], [0], [0], [3]), None, None)
    r.sending(later, None, torch.tensor([[1, 2, 3, 4]]))
    first = r.next()
    assert first.slot == 0 and first.failed is None
    assert first.feed == [(0, 50), (1, 51), (4, 54)] and sorted(first.finished) == [2, 3] and first.written == 3
    assert r.next() is other  # the other slot's answer, in its place
    second = r.next()  # the slot's later pass, computed again after the first
    assert second.feed == [(4, 54)] and second.failed is None
    assert [u.prefill[0].gid if u.prefill else u.decode_rows for u in ring.launched] == [12, 13, [0], [1], 13]
    assert r.culprits == 1 and r.retried == 5 and not ring.incoming
