"""Pipeline links (comm.p2p): every group carries traffic one way, messages go over CPU (gloo) groups,
on CPU with their activations in the same transfer (on GPU payloads take NCCL groups of their own);
the next message's receive is posted before the stage computes; the last message (stop) arrives
before anyone tears the groups down; messages of every size and dtype arrive intact over gloo. A peer
killed mid-run, reported within seconds on the header channel: tests/integration/test_reliability.py.

Real runs: each rank goes through a small wrapper that records every point-to-point send and
receive (group, backend, this rank, the peer) before the runner's own code runs.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import RUNNER, _env, _kill_group, free_port, read_jsonl

RECORDER = '''
import json, os, runpy, sys
import torch.distributed as dist

log = open(f"{os.environ['P2P_LOG']}.{os.environ['RANK_ID']}", "w", buffering=1)

def recording(fn, op):
    def call(tensor, peer=None, group=None, **kw):
        g = group or dist.group.WORLD
        log.write(json.dumps({"op": op, "kind": fn.__name__, "group": g.group_name, "desc": g.group_desc,
                              "backend": dist.get_backend(g), "me": dist.get_rank(), "peer": peer,
                              "dtype": str(tensor.dtype)}) + "\\n")
        return fn(tensor, peer, group, **kw)
    return call

for name, op in (("isend", "send"), ("send", "send"), ("irecv", "recv"), ("recv", "recv")):
    setattr(dist, name, recording(getattr(dist, name), op))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


@pytest.fixture(scope="module")
def model_dir(make_llama):
    return make_llama(num_hidden_layers=3, max_position_embeddings=128)


@pytest.fixture(scope="module")
def requests(tmp_path_factory):
    path = tmp_path_factory.mktemp("links") / "req.jsonl"
    # more than one chunk of 64 lines (tasks.shards), so that both pipelines of a data-parallel run work
    path.write_text("".join(json.dumps({"prompt": f"Request {i}: the garden is", "max_tokens": 1 + i % 3,
                                        "logprobs": 1}) + "\n" for i in range(72)))
    return path


def launch(args, world, pipeline, log=None, env=None):
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    for i in range(world):
        pre = [sys.executable, "-c", RECORDER, str(RUNNER)] if log else [sys.executable, str(RUNNER)]
        procs.append(subprocess.Popen(
            [*pre, *args, "--rank", str(i), "--world-size", str(world), "--pipeline-group-size", str(pipeline),
             "--data-group-size", str(world // pipeline), "--dist-url", url, "--num-threads", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env=_env({**(env or {}), **({"P2P_LOG": str(log), "RANK_ID": str(i)} if log else {})})))
    return procs


def finish(procs, timeout=240):
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            _kill_group(p)


def test_every_group_carries_traffic_one_way(model_dir, requests, tmp_path):
    """Two pipelines of three stages (a middle stage, a ring each, data parallelism) in one launch."""
    world, pipeline = 6, 3
    out, log = tmp_path / "out.jsonl", tmp_path / "p2p"
    procs = launch(["--model-name", model_dir, "--infer-data", str(requests), "--output-path", str(out),
                    "--budget", "300"], world, pipeline, log)
    results = finish(procs)
    assert [p.returncode for p in procs] == [0] * world, "\n".join(r[1][-2000:] for r in results)
    assert len(read_jsonl(out)) == 72
    records = [json.loads(line) for i in range(world) for line in Path(f"{log}.{i}").read_text().splitlines()]
    directions: dict[str, set] = {}
    for r in records:
        src, dst = (r["me"], r["peer"]) if r["op"] == "send" else (r["peer"], r["me"])
        directions.setdefault(r["group"], set()).add((src, dst, r["desc"], r["backend"]))
    for group, used in directions.items():
        assert len(used) == 1, f"group {group} carries traffic both ways or between several pairs: {used}"
    links = {desc: (src, dst, backend) for (src, dst, desc, backend), in directions.values()}
    # every message goes over a gloo group of its link; on CPU there are no payload groups: the
    # activations travel in the message (on GPU they take an NCCL group per link, down the pipeline)
    expect_links = {(d * pipeline + s, d * pipeline + (s + 1) % pipeline) for d in range(world // pipeline)
                    for s in range(pipeline)}
    assert {(src, dst) for src, dst, _ in links.values()} == expect_links, links
    assert all(desc == f"header {src}->{dst}" and b == "gloo" for desc, (src, dst, b) in links.items())
    assert all(r["dtype"] == "torch.uint8" for r in records)
    # receives are posted ahead (irecv); every transfer sent was received (the stop message reached
    # every rank) and one receive per ring link is left over: after the final reply rank 0 posts the
    # next one, which shutdown drops
    assert any(r["op"] == "recv" and r["kind"] == "irecv" for r in records)
    sent = sum(r["op"] == "send" for r in records)
    got = sum(r["op"] == "recv" for r in records)
    assert got - sent == world // pipeline


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


def test_messages_of_every_size_and_dtype_arrive_intact():
    """Activations inline after the header (fp32, bf16, fp16, int64; odd header lengths), a message
    longer than the posted receive (two transfers), header-only messages; a received payload stays
    intact while the next message lands in the link's other buffer."""
    env = dict(_env(None), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, "-c", MESSAGES, str(r)], env=env, stderr=subprocess.PIPE,
                              start_new_session=True) for r in (0, 1)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode()[-2000:]
    finally:
        for p in procs:
            _kill_group(p)
