"""Starting distributed (comm.dist): two ranks on one GPU are found before NCCL refuses them."""

from comm.dist import sharing_a_gpu


def test_two_ranks_on_one_gpu_are_found():
    assert sharing_a_gpu([("a", 0), ("a", 1), ("b", 0)], 0) == []
    assert sharing_a_gpu([("a", 0), ("a", 1), ("a", 0)], 2) == [0, 2]


MESSAGES = """
import datetime, sys, torch, torch.distributed as dist
from comm.p2p import _FIRST, Messenger, open_channels
rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)
channels = open_channels(rank, 2, 1, "gloo", datetime.timedelta(seconds=60))
assert all(c.payload is None for c in channels)  # CPU: activations travel inside the message
m = Messenger(rank, torch.device("cpu"), channels)
gen = torch.Generator().manual_seed(0)
msgs = [(b"decode", torch.randn(32, 1, 768, generator=gen)),
        (b"x" * 5000, torch.randn(3, 700, 768, generator=gen).bfloat16()),  # 3.2 MB: two transfers
        (b"header only", None),
        (b"", torch.arange(7, dtype=torch.int64)),
        (b"odd header length 123", torch.randn(5, 3, generator=gen).half()),
        (b"last", torch.randn(2, 4, generator=gen))]
assert msgs[1][1].numel() * 2 > _FIRST
if rank == 0:
    for h, x in msgs:
        m.send(1, h, x)
    assert m.recv(1) == (b"done", None)
    m.flush()
else:
    prev = None
    for i, (h, x) in enumerate(msgs):
        header, got = m.recv(0)
        assert header == h, (i, header[:20])
        assert (got is None) == (x is None) and (x is None or (got.dtype == x.dtype and torch.equal(got, x))), i
        if prev is not None:  # the message before is still intact while this one arrived
            assert torch.equal(prev[1], msgs[i - 1][1])
        prev = (i, got) if got is not None else None
        if i < len(msgs) - 1:
            m.expect(0)
    m.send(0, b"done")
    m.flush()
dist.destroy_process_group()
"""
