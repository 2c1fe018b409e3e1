"""Shared-prefix KV cache: answers equal the cache-off answers (generation, echo scoring, seeded
sampling) at P = 1, 2, 3, with evictions under a tiny budget and after kill + resume; the cache's
memory stays within --budget; bookkeeping units."""

import json

import pytest

from pipeline.cache.prefix import PrefixCache, block_digests
from pipeline.scheduling.scheduler import Group, Scheduler, SchedulerConfig
from tests.utils import assert_consistent_results, local_tokenizer, read_jsonl, run_inprocess, write_jsonl


@pytest.fixture(scope="module")
def model_dir(make_llama):
    return make_llama(num_hidden_layers=3, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """A few-shot file (one ~250-token prefix, greedy / echo / seeded sampling / best_of), lm-eval-style
    multiple choice (token-id contexts with 4 continuations each, interleaved) and unshared prompts."""
    tok = local_tokenizer()
    shots = "".join(f"Passage: The room {i} is north of the hall {i + 1}.\nQuestion: Where is room {i}?\n"
                    f"Answer: north\n\n" for i in range(6))
    lines = []
    for i in range(10):
        q = f"Passage: The garden is {'west' if i % 2 else 'east'} of the office {i}.\nQuestion: Where is the garden?\nAnswer:"
        lines.append({"prompt": shots + q, "max_tokens": 3, "temperature": 0, "logprobs": 2})
        if i % 3 == 0:
            lines.append({"prompt": shots + q + " west", "max_tokens": 0, "echo": True, "logprobs": 3})
        if i % 4 == 1:
            lines.append({"prompt": shots + q, "max_tokens": 4, "temperature": 0.8, "seed": i, "n": 2})
        if i == 5:
            lines.append({"prompt": shots + q, "max_tokens": 3, "temperature": 0.7, "best_of": 2, "seed": 3})
    contexts = [tok(f"Context {c}: the kitchen is south of the bedroom and the bathroom is east of the "
                    f"kitchen, so the bedroom is")["input_ids"] for c in range(4)]
    for j in range(4):  # interleaved: context 0..3 with continuation j, then j + 1
        for ctx in contexts:
            cont = tok(f" {['north', 'south', 'west', 'east'][j]} of the bathroom", add_special_tokens=False)["input_ids"]
            lines.append({"prompt": ctx + cont, "max_tokens": 0, "echo": True, "logprobs": 1})
    # scored blocks met again with more top logprobs than they hold, and with none
    lines.append({"prompt": contexts[0] + [5, 6, 7], "max_tokens": 0, "echo": True, "logprobs": 4})
    lines.append({"prompt": contexts[1] + [8, 9], "max_tokens": 1, "echo": True, "temperature": 0})
    lines += [{"prompt": f"Unshared prompt {i} about the office.", "max_tokens": 3, "temperature": 0} for i in range(4)]
    return write_jsonl(tmp_path_factory.mktemp("prefix") / "work.jsonl", lines)


@pytest.fixture(scope="module")
def reference(model_dir, workload, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "off.jsonl"
    assert run_inprocess(["--model-name", model_dir, "--infer-data", workload, "--output-path", str(out),
                          "--prefix-cache", "off", "--no-progress"]) == 0
    lines = read_jsonl(out)
    assert all(x["result"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for x in lines)
    return lines


def assert_same_answers(ours: list[dict], ref: list[dict]) -> None:
    """Greedy and scoring answers equal (text, tokens, logprobs within 1e-4, the same top logprobs);
    seeded samples consistent (identical tokens up to a rounding-level divergence)."""
    assert len(ours) == len(ref)
    sampled_a, sampled_b = [], []
    for a, b in zip(ours, ref):
        if b["request"].get("temperature", 1) > 0 and b["request"].get("max_tokens", 16) > 0:
            sampled_a.append(a)
            sampled_b.append(b)
            continue
        for ca, cb in zip(a["result"]["choices"], b["result"]["choices"], strict=True):
            assert ca["text"] == cb["text"]
            la, lb = ca["logprobs"], cb["logprobs"]
            if lb is None:
                continue
            assert la["tokens"] == lb["tokens"]
            for x, y in zip(la["token_logprobs"], lb["token_logprobs"], strict=True):
                assert (x is None and y is None) or abs(x - y) < 1e-4
            assert (la["top_logprobs"] is None) == (lb["top_logprobs"] is None)
            for ta, tb in zip(la["top_logprobs"] or [], lb["top_logprobs"] or [], strict=True):
                if tb is None:
                    assert ta is None
                    continue
                assert set(ta) == set(tb)
                assert all(abs(ta[k] - tb[k]) < 1e-4 for k in tb)
    strip = lambda x: {**x, "result": {**x["result"], "usage": {k: v for k, v in x["result"]["usage"].items()
                                                                 if k != "prompt_tokens_details"}}}
    assert_consistent_results([strip(x) for x in sampled_a], [strip(x) for x in sampled_b])


def cached(lines: list[dict]) -> list[int]:
    return [x["result"]["usage"]["prompt_tokens_details"]["cached_tokens"] for x in lines]


def test_p1_answers_equal_cache_off_and_prefixes_hit(model_dir, workload, reference, tmp_path):
    out = tmp_path / "on.jsonl"
    assert run_inprocess(["--model-name", model_dir, "--infer-data", workload, "--output-path", str(out),
                          "--no-progress"]) == 0
    lines = read_jsonl(out)
    assert_same_answers(lines, reference)
    hits = cached(lines)
    fewshot = [h for x, h in zip(lines, hits) if "Passage: The room 0" in str(x["request"]["prompt"])]
    assert sum(h > 0 for h in fewshot) >= len(fewshot) - 1  # every few-shot request but the first hits
    mc = [h for x, h in zip(lines, hits) if isinstance(x["request"]["prompt"], list)]
    assert sum(h > 0 for h in mc) >= 12  # 3 of each context's 4 continuations reuse its blocks
    assert all(h == 0 for x, h in zip(lines, hits) if "Unshared" in str(x["request"]["prompt"]))
    summary = json.loads((tmp_path / "on.jsonl.summary.json").read_text())
    assert summary["cached_prompt_tokens"] == sum(hits) and summary["prefix_hit_rate"] > 0.5


# -- bookkeeping --------------------------------------------------------------------------------

def test_digests_chain_over_the_whole_prefix():
    a = block_digests(list(range(40)), 16)
    b = block_digests(list(range(32)) + [7] * 8, 16)
    c = block_digests([99] + list(range(1, 40)), 16)
    assert len(a) == 2 and a == b  # the partial third block has no digest
    assert c[0] != a[0] and c[1] != a[1]  # a different first block changes every later digest


def test_plan_hits_saves_only_shared_blocks_and_evicts_lru():
    pc = PrefixCache(4, budget=64)  # at most 8 blocks of 4
    shared = list(range(12))
    d1, d2 = block_digests(shared + [50, 51], 4), block_digests(shared + [60], 4)
    pc.queued(d1), pc.queued(d2)
    pinned: set[int] = set()
    assert pc.plan(len(shared + [50, 51]), d1, room=64, pinned=pinned)[0:2] == (0, [])
    cached, load, save, _ = pc.plan(len(shared + [60]), d2, room=64, pinned=set())
    assert cached == 12 and len(load) == 3 and save == []
    lone = list(range(100, 120))
    assert pc.plan(len(lone), block_digests(lone, 4), room=64, pinned=set())[2] == []  # nobody shares it
    # a whole prompt in the pool still computes its last token
    again = block_digests(shared, 4)
    assert pc.plan(len(shared), again, room=64, pinned=set())[0] == 11
    # fill the pool with other shared prompts: the oldest blocks go first, never pinned ones
    for k in range(3):
        other = [200 + 10 * k + i for i in range(8)]
        dg = block_digests(other, 4)
        pc.queued(dg), pc.queued(dg)
        pc.plan(len(other), dg, room=0, pinned=set())
    assert pc.capacity <= pc.max_blocks == 8
    assert len(pc.blocks) <= 8


def test_a_chunked_prompt_saves_each_chunks_shared_blocks():
    """Chunked prefill: the first pass saves the shared blocks of its chunk and reports how many of the
    prompt's blocks are shared; each later chunk saves those it computes (unshared ones never)."""
    pc = PrefixCache(4, budget=1000)
    shared = list(range(24))  # 6 blocks of 4 shared with a second prompt
    ids, other = shared + [90 + i for i in range(10)], shared + [70, 71, 72]
    d = block_digests(ids, 4)
    pc.queued(d), pc.queued(block_digests(other, 4))  # both queued (the driver queues at submission)
    pinned, saving = set(), set()
    cached, load, save, blocks = pc.plan(len(ids), d, room=1000, pinned=pinned, saving=saving, chunk=8)
    assert (cached, load, [b for b, _ in save], blocks) == (0, [], [0, 1], 6)
    later = [pc.plan_chunk(d, start, min(start + 8, len(ids)), blocks, room=1000, pinned=set(), saving=set())
             for start in (8, 16, 24, 32)]
    assert [[b for b, _ in s] for s in later] == [[2, 3], [4, 5], [], []]  # blocks 6.. are this prompt's own
    cached, load, save, _ = pc.plan(len(other), block_digests(other, 4), room=1000, pinned=set())
    assert cached == 24 and len(load) == 6


def test_scheduler_holds_a_second_prompt_of_a_new_prefix_for_one_pass():
    pc = PrefixCache(4, budget=1000)
    s = Scheduler(SchedulerConfig(1000, 1, 8), prefix=pc)
    for gid, key in enumerate([b"A", b"A", b"B", None]):
        s.submit(Group(gid, 10, 2, digests=(key,) if key else ()))
    first = s.next_pass(0)
    assert [gid for gid, _ in first.prefill] == [0, 2, 3]  # group 1 waits for block A
    assert first.alloc == (3, 13)  # one spare column
    s.on_reply(0, [1, 2], [0])  # group 0 finished: its row is free
    pc.blocks[b"A"] = 0  # what the driver's plan did for group 0
    assert s.next_pass(0).prefill == [(1, 0)]


def test_pool_growth_stays_within_the_room_it_is_given():
    """One prompt saving many blocks grows the pool only into the budget left (found at P = 3 with a
    tiny budget: every save used to see the same room)."""
    pc = PrefixCache(4, budget=1000)
    ids = list(range(40))
    d = block_digests(ids, 4)
    pc.queued(d), pc.queued(d)
    cached, load, save, _ = pc.plan(len(ids), d, room=12, pinned=set())
    assert pc.cells == 12 and len(save) == 3  # three blocks fit; the rest are not kept
    assert pc.take_grow() == 3


def test_scheduler_keeps_resumed_and_fresh_prompts_in_separate_passes():
    """A pass computes every new prompt to the longest one's length: a prompt that resumes after
    cached blocks (few tokens left) must not be padded to a fresh prompt's length."""
    pc = PrefixCache(4, budget=4000)
    s = Scheduler(SchedulerConfig(4000, 1, 8), prefix=pc)
    cached = (b"A", b"B", b"C", b"D")  # 16 tokens resident: 2 left of 18
    pc.blocks.update({d: i for i, d in enumerate(cached)})
    s.submit(Group(0, 18, 2, digests=cached))
    s.submit(Group(1, 18, 2, digests=(b"X", b"Y", b"Z", b"W")))  # nothing resident: 18 to compute
    s.submit(Group(2, 18, 2, digests=cached))
    s.submit(Group(3, 17, 2))  # too short for a block, but computed whole
    first = s.next_pass(0)
    assert [gid for gid, _ in first.prefill] == [0, 2]
    s.on_reply(0, [], [r for _, r in first.prefill])
    assert [gid for gid, _ in s.next_pass(0).prefill] == [1, 3]


def test_scoring_work_spreads_over_the_micro_batches_of_a_pipeline():
    """Multiple choice at P = 2: 8 contexts of 40 tokens x 4 continuations, interleaved. With two
    micro-batches no pass takes more than half a slot's even share of the scoring work (so the stages
    work at once instead of taking turns); with one, the first pass takes every fresh context; a
    generating file is packed as before."""
    def submit(s, max_tokens=0):
        gid = 0
        for j in range(4):
            for c in range(8):
                ids = [100 + c] * 40 + [j, j]
                s.submit(Group(gid, len(ids), max_tokens, digests=tuple(block_digests(ids, 4))))
                gid += 1

    firsts = {}
    for slots in (1, 2):
        pc = PrefixCache(4, budget=100_000)
        s = Scheduler(SchedulerConfig(100_000, slots, 64), prefix=pc)
        submit(s)
        firsts[slots] = [len(s.next_pass(i).prefill) for i in range(slots)]
    assert firsts[1] == [8]  # every fresh context (the continuations wait for their blocks)
    assert firsts[2] == [2, 2]  # 8 x 42 fresh + 24 x 2 resumed = 384 tokens: 96 per pass
    s = Scheduler(SchedulerConfig(100_000, 2, 64), prefix=PrefixCache(4, budget=100_000))
    submit(s, max_tokens=5)
    assert len(s.next_pass(0).prefill) == 8


def test_a_prompt_over_the_budget_with_the_spare_column_gets_an_error_naming_it(model_dir, tmp_path):
    """With the cache on a row takes one spare column: a request needing exactly --budget cells
    without it is refused in its place with the count that includes it; the next line still runs."""
    ids = list(range(5, 65))  # 60 prompt tokens + max_tokens 4 = 64 = the budget
    data = write_jsonl(tmp_path / "in.jsonl", [{"prompt": ids, "max_tokens": 4, "temperature": 0},
                                               {"prompt": ids[:20], "max_tokens": 4, "temperature": 0}])
    out = tmp_path / "out.jsonl"
    run_inprocess(["--model-name", model_dir, "--infer-data", data, "--output-path", str(out), "--budget", "64",
                   "--no-progress"])
    first, second = read_jsonl(out)
    msg = first["error"]["message"]
    assert "needs 65 KV-cache tokens" in msg and "spare column" in msg and "--budget 64" in msg, msg
    assert second["result"]["usage"]["completion_tokens"] == 4


def test_echo_over_cached_blocks_reads_stored_scores_and_runs_the_head_once_per_block():
    """The last stage keeps each scored block's logprobs and top logprobs: a later echo request over
    the same blocks runs the head over one position per block (whose next token lies outside it) and
    its own new positions, and gets what a full computation gives; more top logprobs than stored
    recompute from the kept hidden states once, then are stored too."""
    import torch

    from pipeline.output.head import Head
    from pipeline.runtime.messages import Prefill
    from pipeline.cache.prefix import PrefixStore

    torch.manual_seed(0)
    weight, head_rows = torch.randn(40, 8), []

    class Model:
        def head(self, h):
            head_rows.append(h.shape[0])
            return h @ weight.T

    head = Head(Model(), local_tokenizer(), set(), "m", 0)
    pool = PrefixStore(4, keep_hidden=True)
    pool.resize(4, torch.zeros(1, 1, 1, 1, 2), hidden=8)
    shared, ids = torch.randn(8, 8), list(range(1, 14))

    def full(hidden, toks, k):  # what a cache-off echo gives
        lp = torch.log_softmax(hidden[:-1] @ weight.T, -1)
        return [None] + lp.gather(-1, torch.tensor(toks[1:])[:, None]).flatten().tolist(), lp.topk(k, -1).indices

    def check(out, hidden, toks, k):
        lps, top_ids = full(hidden, toks, k)
        assert out["logprobs"][0] is None and torch.allclose(torch.tensor(out["logprobs"][1:]), torch.tensor(lps[1:]), atol=1e-5)
        assert [[i for i, _ in t] for t in out["top"][1:]] == top_ids.tolist()

    first = torch.cat([shared, torch.randn(5, 8)])  # 13 tokens: blocks 0 and 1 are kept in pool blocks 2, 3
    pool.h[8:16] = shared
    check(head.scorer.score(first, ids, 2, Prefill(1, 0, 13, save=[[0, 2], [1, 3]]), pool), first, ids, 2)
    assert head_rows == [12] and pool.scored == [-1, -1, 2, 2]
    for k, rows in ((2, [2, 2]), (1, [2, 2]), (3, [8, 2]), (3, [2, 2])):  # k = 3: wider than stored, once
        head_rows.clear()
        new, toks = torch.randn(3, 8), ids[:8] + [30 + k, 31, 32]
        out = head.scorer.score(new, toks, k, Prefill(2, 0, 11, cached=8, load=[2, 3]), pool)
        check(out, torch.cat([shared, new]), toks, k)
        assert head_rows == rows, (k, head_rows)


@pytest.mark.parametrize("prefix", ["on", "off"])
def test_chunked_prefill_equals_whole_prompts(model_dir, workload, reference, tmp_path, monkeypatch, prefix):
    """--prefill-chunk 48: every generating prompt longer than 48 tokens is computed 48 tokens a pass
    (resuming after its earlier chunks, and after prefix-cache hits); the answers equal whole-prompt
    prefills, echo scoring and best_of keep whole prompts, and prefixes still hit."""
    from pipeline.scheduling.scheduler import Scheduler

    chunks = []  # (prompt length, where a pass's part of it ends)
    real = Scheduler.next_pass

    def next_pass(self, sid, ahead=False):
        ps = real(self, sid, ahead)
        chunks.extend((p.prompt_len, p.end) for p in (ps.prompts if ps is not None else ()))
        return ps

    monkeypatch.setattr(Scheduler, "next_pass", next_pass)
    out = tmp_path / "chunked.jsonl"
    assert run_inprocess(["--model-name", model_dir, "--infer-data", workload, "--output-path", str(out),
                          "--prefill-chunk", "48", "--prefix-cache", prefix, "--no-progress"]) == 0
    lines = read_jsonl(out)
    assert_same_answers(lines, reference)
    partial = [(n, done) for n, done in chunks if done < n]
    if prefix == "off":  # the 10 greedy few-shot prompts (191 tokens): 48, 96, 144, then the rest
        assert partial.count((191, 48)) == partial.count((191, 144)) >= 10 and all(d % 48 == 0 for _, d in partial)
    else:  # prefix hits leave fewer tokens to compute, most prompts fit one chunk after them
        assert partial
    assert (sum(cached(lines)) > 0) == (prefix == "on")


def test_chunked_prompts_share_a_prefix_longer_than_a_chunk(model_dir, tmp_path):
    """Only chunked prompts share a ~155-token few-shot prefix (chunks of 48): every chunk saves the
    shared blocks it computes, so the later prompts find the whole prefix, not only the first chunk."""
    shots = "".join(f"Passage: The room {i} is north of the hall {i + 1}.\nQuestion: Where is room {i}?\n"
                    f"Answer: north\n\n" for i in range(6))
    path = write_jsonl(tmp_path / "fewshot.jsonl", [{"prompt": shots + f"Question {i}: where is the hall?\nAnswer:",
                                                      "max_tokens": 2, "temperature": 0} for i in range(6)])
    out = tmp_path / "out.jsonl"
    assert run_inprocess(["--model-name", model_dir, "--infer-data", path, "--output-path", str(out),
                          "--prefill-chunk", "48", "--max-micro-batch-size", "1", "--no-progress"]) == 0
    hits = cached(read_jsonl(out))
    assert hits[0] == 0 and min(hits[1:]) >= 144, hits  # 9+ blocks of 16: beyond the first chunk
