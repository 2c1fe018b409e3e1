"""The prefix cache under chunked prefill, without a model: rank 0's driver and scheduler build the
passes (a second pass ahead while a slot only computes prompts, as with several stages), and a
stand-in stage applies them in order with the real :class:`~pipeline.cache.prefix.PrefixStore`, its "keys",
"values" and final hidden states being the prompt's token ids. So every load must bring a prompt's
own tokens into its first columns, every saved block must hold its tokens, and every prompt sharing a
prefix with an earlier one must find all of its full blocks, whatever the chunk and block sizes
(chunks not a multiple of blocks, chunks shorter than a block, a prefix ending mid-chunk)."""

from collections import deque

import orjson
import pytest
import torch

from pipeline.scheduling.driver import Driver
from pipeline.runtime.messages import PassHeader, Reply
from pipeline.cache.prefix import PrefixCache, PrefixStore, block_digests
from pipeline.scheduling.scheduler import Scheduler, SchedulerConfig


class FakeCache:
    """A micro-batch's cache as PrefixStore reads and writes it: (layers, rows, kv_heads, cols, head_dim)
    = (1, rows, 1, cols, 1), holding the token id computed at each column (-1: nothing yet)."""

    def __init__(self, rows: int, cols: int):
        self.k = torch.full((1, rows, 1, cols, 1), -1.0)
        self.v = self.k.clone()

    def tokens(self, row: int, n: int) -> list[int]:
        return self.k[0, row, 0, :n, 0].long().tolist()

    def copy_lead(self, lead: int, rows: list[int], cols: int) -> None:  # a best_of fork of the cache
        self.k[:, rows, :, :cols] = self.k[:, lead : lead + 1, :, :cols]
        self.v[:, rows, :, :cols] = self.v[:, lead : lead + 1, :, :cols]


class Run:
    """Rank 0 (a real Driver and Scheduler) and a stand-in last stage that checks every pass."""

    def __init__(self, requests: list[dict], block: int, chunk: int, slots: int = 3, budget: int = 100_000):
        self.sched = Scheduler(SchedulerConfig(budget, slots, 8, chunk=chunk, prefill_tokens=256, stages=2),
                               prefix=PrefixCache(block, budget))
        self.driver = Driver(None, 1000, 4096, self.sched)
        self.driver.start(iter(enumerate(orjson.dumps(r) for r in requests)))
        self.pool = PrefixStore(block, keep_hidden=True)
        self.caches: dict[int, FakeCache] = {}
        self.prompt: dict[int, list[int]] = {}  # gid -> prompt ids
        self.left: dict[tuple[int, int], int] = {}  # (slot, row) -> tokens still to generate
        self.first: dict[int, int] = {}  # gid -> cached tokens of its first pass (prefix-pool hits)
        self.chunks: dict[int, int] = {}  # gid -> passes computing its prompt
        self.ahead = 0  # passes built while the slot's previous one was in flight

    def run(self) -> "Run":
        inflight: deque[PassHeader] = deque()
        for _ in range(10_000):
            self.driver.fill()
            for sid in self.driver.slot_ids:  # as pipeline.runtime.engine.Engine._launch does
                while True:
                    busy = any(h.slot == sid for h in inflight)
                    if (built := self.driver.next_pass(sid, busy)) is None:
                        break
                    hdr = built[0]
                    self.ahead += busy
                    self.step(hdr)
                    inflight.append(hdr)
            if not inflight:
                assert self.driver.done, "stalled with work queued"
                return self
            self.driver.on_reply(self.reply(inflight.popleft()))
        raise AssertionError("did not finish")

    def step(self, hdr: PassHeader) -> None:
        """What a stage does with the pass (pipeline.runtime.stage.Stage.step), checking what it loads."""
        for meta in hdr.admit:
            self.prompt[meta.gid] = meta.prompt_ids
            for r in meta.rows:
                self.left[(hdr.slot, r)] = meta.params.max_tokens
        if hdr.alloc:
            self.caches[hdr.slot] = FakeCache(*hdr.alloc)
        cache = self.caches[hdr.slot]
        if hdr.prefix_grow is not None:
            self.pool.resize(hdr.prefix_grow, cache.k, hidden=1)
        for r, col in zip(hdr.decode_layout, hdr.decode_start):
            cache.k[0, r, 0, col, 0] = cache.v[0, r, 0, col, 0] = -2.0  # a generated token
        out = torch.full((len(hdr.prefill), hdr.prefill_len, 1), -3.0)
        for i, p in enumerate(hdr.prefill):
            ids = self.prompt[p.gid]
            if p.load:
                self.pool.load(cache, p.row, p.load, p.cached)
            assert cache.tokens(p.row, p.cached) == ids[: p.cached], "the cached columns hold another prompt"
            computed = torch.tensor(ids[p.cached : p.len], dtype=torch.float)
            cache.k[0, p.row, 0, p.cached : p.len, 0] = cache.v[0, p.row, 0, p.cached : p.len, 0] = computed
            out[i, : p.len - p.cached, 0] = computed
            self.first.setdefault(p.gid, p.cached)
            self.chunks[p.gid] = self.chunks.get(p.gid, 0) + 1
        if hdr.prefill:
            self.pool.save_pass(hdr.slot, hdr.prefill, cache, out)
        for f in hdr.forks:
            cache.copy_lead(f.lead, f.rows, f.cols)

    def reply(self, hdr: PassHeader) -> Reply:
        """The last rank's answer: a token for each row that produced one, finished rows."""
        produced = list(hdr.decode_rows)
        for p in hdr.prefill:
            if not p.partial:
                produced += [r for (s, r) in self.left if s == hdr.slot and self.sched.slots[s].row_group[r] == p.gid]
        feed, finished = [], []
        for r in produced:
            self.left[(hdr.slot, r)] -= 1
            (finished if self.left[(hdr.slot, r)] <= 0 else feed).append(r)
        for r in finished:
            del self.left[(hdr.slot, r)]
        return Reply(hdr.slot, [(r, 7) for r in feed], finished)

    def check_pool(self, block: int) -> None:
        """Every resident block holds its tokens: keys, values and final hidden states."""
        content = {d: ids[b * block : (b + 1) * block] for ids in self.prompt.values()
                   for b, d in enumerate(block_digests(ids, block))}
        for d, bid in self.sched.prefix.blocks.items():
            span = slice(bid * block, (bid + 1) * block)
            for t in (self.pool.k[0, 0, span, 0], self.pool.v[0, 0, span, 0], self.pool.h[span, 0]):
                assert t.long().tolist() == content[d], f"pool block {bid}"


def fewshot(prefix_len: int, n: int, seed: int) -> list[dict]:
    """``n`` greedy requests sharing a ``prefix_len``-token prefix, each with its own question
    (first tokens distinct, 3-29 tokens), and a few that share nothing."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(100, 900, (prefix_len,), generator=g).tolist()
    reqs = []
    for i in range(n):
        tail = [10 + i] + torch.randint(100, 900, (3 + (7 * i) % 27,), generator=g).tolist()
        reqs.append({"prompt": prefix + tail, "max_tokens": 1 + i % 3, "temperature": 0})
    reqs.insert(3, {"prompt": [60, 61, 62, 63, 64], "max_tokens": 2, "temperature": 0})  # shorter than a block
    reqs.insert(5, {"prompt": prefix + [70, 71], "max_tokens": 0, "echo": True, "logprobs": 1})  # whole prompt
    reqs.insert(7, {"prompt": prefix + [80, 81, 82], "max_tokens": 2, "best_of": 2, "temperature": 0.5})
    return reqs


@pytest.mark.parametrize("block, chunk", [(16, 64), (16, 40), (16, 8), (7, 48), (16, 0), (4, 5)])
def test_a_chunked_prompt_loads_resident_blocks_and_saves_the_ones_it_computes(block, chunk):
    """Chunks of 64 over blocks of 16, 40 (chunk ends inside blocks), 8 (a block over two chunks), 48
    over 7, 5 over 4; a 100-token prefix (ends mid-chunk and mid-block): the first prompt computes it,
    chunk by chunk, saving each full block as the chunk that completes it ends; every later prompt
    sharing it (chunked or not, best_of, echo) waits for it and loads all of its full blocks, then
    computes only the rest; what every load brings and every block holds is the prompt's own tokens."""
    reqs = fewshot(100, 12, seed=block * 100 + chunk)
    run = Run(reqs, block, chunk).run()
    run.check_pool(block)
    shared = 100 // block * block
    hits = [run.first[gid] for gid in sorted(run.first)]
    assert len(hits) == len(reqs)
    for r, h in zip(reqs, hits):
        if r["prompt"][0] == 60:
            assert h == 0  # shorter than a block: no digest, nothing to find
    sharing = [h for r, h in zip(reqs, hits) if len(r["prompt"]) > 100]
    assert sharing[0] == 0 and all(h == shared for h in sharing[1:]), (shared, hits)
    if chunk:
        assert max(run.chunks.values()) >= 100 // chunk  # the first prompt was computed chunk by chunk
        assert run.ahead > 0  # ... with a second pass in flight


def test_a_chunk_completing_a_block_an_earlier_chunk_began_keeps_its_hidden_states():
    """PrefixStore.chunk_hidden: chunks of 6 over blocks of 4 (0-5, 6-11): the second completes block 1
    (positions 4-7) and gets positions 4-5 from what the first kept; a third chunk needs nothing."""
    pool = PrefixStore(4, keep_hidden=True)
    h = torch.arange(12.0)[:, None]
    kept, start = pool.chunk_hidden((0, 1), h[0:6], 0, 6, resumed=False, partial=True)
    assert start == 0 and pool.tails[(0, 1)].flatten().tolist() == [4, 5]
    kept, start = pool.chunk_hidden((0, 1), h[6:12], 6, 12, resumed=True, partial=True)
    assert start == 4 and kept.flatten().tolist() == [4, 5, 6, 7, 8, 9, 10, 11] and (0, 1) not in pool.tails
    pool.forget([0])
    assert pool.tails == {}


# end to end, default flags at P = 2 and 3 against cache off and HF: tests/runs/test_prefix_cache_runs.py
