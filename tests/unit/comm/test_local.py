"""In-memory links (comm.local): the framed bytes of comm.p2p, a dead peer heard, the group's agreement."""

from __future__ import annotations

import threading

import pytest
import torch

from comm.dist import local_infos
from comm.local import LocalMessenger, LocalWorld
from comm.p2p import PeerLost, frame, unframe
from pipeline.runtime.link import Link
from pipeline.runtime.messages import Allocate, Stop


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8])
@pytest.mark.parametrize("shape", [(0,), (5,), (3, 7), (2, 1, 9)])
def test_frame_round_trip(dtype, shape):
    x = (torch.arange(torch.Size(shape).numel()) % 100).to(dtype).reshape(shape)
    header, y = unframe(frame(b"hdr\x00bytes", x))
    assert header == b"hdr\x00bytes"
    if x.numel() == 0:
        assert y is None
    else:
        assert y.dtype == dtype and y.shape == x.shape and torch.equal(y, x)
    assert unframe(frame(b"", None)) == (b"", None)


def test_messages_between_threads_arrive_in_order_with_their_tensors():
    infos = local_infos(3)
    links = [Link(i, LocalMessenger(i.rank, i.device, i.local)) for i in infos]
    got = []

    def middle():
        for _ in range(20):
            msg, x = links[1].recv_prev()
            links[1].send_next(msg, None if x is None else x * 2)

    t = threading.Thread(target=middle)
    t.start()
    for k in range(20):
        links[0].send_next(Allocate(k, k + 1, 4), torch.full((2, 3), float(k)) if k % 2 else None)
    for _ in range(20):
        got.append(links[2].recv_prev())
    t.join()
    assert [m.slot for m, _ in got] == list(range(20))
    for k, (_, x) in enumerate(got):
        assert (x is None) == (k % 2 == 0)
        if x is not None:
            assert torch.equal(x, torch.full((2, 3), 2.0 * k))


def test_a_dead_rank_is_heard_after_its_last_messages():
    world = LocalWorld(2)
    a, b = LocalMessenger(0, torch.device("cpu"), world), LocalMessenger(1, torch.device("cpu"), world)
    a.send(1, b"last words")
    world.fail(0, "RuntimeError: boom")
    assert b.recv(0)[0] == b"last words"
    with pytest.raises(PeerLost, match="rank 0 stopped: RuntimeError: boom"):
        b.recv(0)
    with pytest.raises(PeerLost):
        b.send(0, b"to the dead")


def test_group_agrees_on_the_least_value_and_breaks_when_a_rank_fails():
    world = LocalWorld(3)
    out = [None] * 3

    def call(r):
        out[r] = [world.group.agree_min(v) for v in (10 + r, 5 - r, 7)]

    threads = [threading.Thread(target=call, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [[10, 3, 7]] * 3
    world.fail(2, "gone")
    with pytest.raises(PeerLost):
        world.group.agree_min(1)


def test_stop_is_delivered_like_any_message():
    infos = local_infos(2)
    first, last = (Link(i, LocalMessenger(i.rank, i.device, i.local)) for i in infos)
    first.send_next(Stop())
    assert isinstance(last.recv_prev()[0], Stop)
