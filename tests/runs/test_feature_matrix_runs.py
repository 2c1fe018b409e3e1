"""Features that combine: a pairwise (all-pairs) matrix over the options that change what a pass
computes. Every pair of option values appears in at least one run; each run either is refused before
loading with a message naming the flags that do not go together, or gives the answers of its reference
(the same numerics at P = 1 with whole prompts and no prefix cache: HF's greedy tokens and logprobs for
float32, a looser tolerance for int8 and bfloat16, bit-identical outputs under --batch-invariant) while
each feature's own effect shows: cached tokens where prefixes are shared and the cache is on, int8 and
bfloat16 in the summary's precision, adapter answers unlike the base's, n choices, echoed prompt
logprobs, text cut at a stop string, the data groups in the summary.

Request-level features (n, best_of, echo, stop strings, LoRA requests beside base ones) are in every
run's file, so they meet every run-level option value. Passes ahead have no flag: they run whenever a
pipeline (P > 1) computes chunked prompts.

Every run is in this process (``--in-process``: P stages x D pipelines as threads, the same rank loops
and messages as under torchrun); a ``serve`` run's requests go over HTTP to a server of the run's
options on a thread (tests/servers.py).
"""

from __future__ import annotations

import json
import random
import urllib.request
from pathlib import Path

import pytest

from tests.utils import (free_port, hf_greedy, local_tokenizer, read_jsonl, run_inprocess, run_local, strip_volatile,
                         write_jsonl)

FACTORS: dict[str, tuple] = {  # the first value of each is what a refusal check leaves the others at
    "stages": (1, 2, 3),
    "chunk": (False, True),  # --prefill-chunk 16 / 0
    "prefix": (True, False),  # --prefix-cache on / off
    "lora": (False, True),  # --lora (and requests naming the adapter)
    "int8": (False, True),  # --quantize int8
    "kv8": (False, True),  # --kv-cache-dtype int8
    "bf16": (False, True),  # --dtype bfloat16
    "invariant": (False, True),  # --batch-invariant
    "serve": (False, True),  # requests over HTTP instead of a file
    "data": (1, 2),  # --data-group-size
}


def pair(a: tuple, b: tuple) -> frozenset:
    return frozenset({a, b})


# Refused before loading (pipeline/config/options.py check_options), with both flags in the message
REFUSED: dict[frozenset, tuple[str, str]] = {
    pair(("lora", True), ("int8", True)): ("--quantize", "--lora"),
    pair(("lora", True), ("invariant", True)): ("--batch-invariant", "--lora"),
    pair(("int8", True), ("invariant", True)): ("--quantize", "--batch-invariant"),
    pair(("chunk", True), ("invariant", True)): ("--prefill-chunk", "--batch-invariant"),
    pair(("serve", True), ("data", 2)): ("--serve", "--data-group-size"),
}
ADAPTER = "bot"
SHOTS = "".join(f"Passage: The room {i} is north of the hall {i + 1}.\nQuestion: Where is room {i}?\nAnswer: north\n\n"
                for i in range(3))
STOP = ["e", "a"]


def pairs_of(run: dict) -> set[frozenset]:
    items = sorted(run.items())
    return {pair(a, b) for i, a in enumerate(items) for b in items[i + 1 :]}


def allowed(run: dict) -> bool:
    return not any(p <= set(run.items()) for p in REFUSED)


def all_pairs(factors: dict[str, tuple], seed: int = 0, tries: int = 40) -> list[dict]:
    """A small set of allowed runs covering every allowed pair of option values (greedy, AETG-style:
    each new run starts from an uncovered pair and picks the other values covering most new pairs;
    the best of ``tries`` candidates is kept)."""
    names = list(factors)
    uncovered = {pair((a, x), (b, y)) for i, a in enumerate(names) for b in names[i + 1 :]
                 for x in factors[a] for y in factors[b]} - set(REFUSED)
    rng, runs = random.Random(seed), []
    while uncovered:
        best, gain = None, 0
        for _ in range(tries):
            run = dict(rng.choice(sorted(uncovered, key=lambda p: sorted(map(repr, p)))))
            for f in rng.sample([n for n in names if n not in run], len(names) - len(run)):
                values = [v for v in factors[f] if allowed({**run, f: v})]
                run[f] = max(values, key=lambda v: sum(pair((f, v), (g, w)) in uncovered for g, w in run.items()))
            new = len(pairs_of(run) & uncovered)
            if new > gain:
                best, gain = run, new
        runs.append({n: best[n] for n in names})
        uncovered -= pairs_of(best)
    return runs


RUNS = all_pairs(FACTORS)


def test_the_runs_cover_every_pair_and_stay_small():
    covered = set().union(*(pairs_of(r) for r in RUNS))
    names = list(FACTORS)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for x in FACTORS[a]:
                for y in FACTORS[b]:
                    p = pair((a, x), (b, y))
                    assert p in covered or p in REFUSED, p
    assert all(allowed(r) for r in RUNS) and len(RUNS) <= 12, RUNS


# -- the requests, the model, the references ----------------------------------------------------

def requests(lora: bool) -> list[dict]:
    """Few-shot greedy requests sharing SHOTS (~80 tokens: 5 blocks, 5 chunks), one of them again with
    the adapter (with --lora), n, best_of, echo, and a prompt with and without stop strings."""
    q = [SHOTS + f"Passage: The garden is east of the office {i}.\nQuestion: Where is the garden?\nAnswer:"
         for i in range(5)]
    adapter = {"model": ADAPTER} if lora else {}
    return [
        {"prompt": q[0], "max_tokens": 4, "temperature": 0, "logprobs": 1},
        {"prompt": q[0], "max_tokens": 4, "temperature": 0, "logprobs": 1, **adapter},
        {"prompt": q[1], "max_tokens": 3, "temperature": 0, "logprobs": 1, "n": 2, **adapter},
        {"prompt": q[2], "max_tokens": 3, "temperature": 0, "logprobs": 1, "best_of": 3, "n": 2},
        {"prompt": q[3], "max_tokens": 2, "temperature": 0, "logprobs": 1, "echo": True},
        {"prompt": q[4], "max_tokens": 0, "logprobs": 1, "echo": True},
        {"prompt": "The kitchen is", "max_tokens": 12, "temperature": 0, "logprobs": 1},
        {"prompt": "The kitchen is", "max_tokens": 12, "temperature": 0, "logprobs": 1, "stop": STOP},
    ]


SHARED = (0, 3, 4, 5)  # base requests after SHOTS


@pytest.fixture(scope="module")
def setup(make_llama, tmp_path_factory):
    """The model (head dim 16: int8 KV records need a multiple of 4), a LoRA adapter and its merged
    HF model, and the request files with and without adapter requests."""
    from tests.unit.pipeline.models.test_lora import make_adapter, merged

    d = tmp_path_factory.mktemp("matrix")
    model = make_llama(num_hidden_layers=3, max_position_embeddings=512)
    adapter = make_adapter(model, d / "adapter", ["q_proj", "v_proj", "down_proj"], seed=3)
    files = {lora: write_jsonl(d / f"requests-{int(lora)}.jsonl", requests(lora)) for lora in (False, True)}
    return {"model": model, "adapter": adapter, "merged": merged(model, adapter, d / "merged"), "files": files,
            "refs": {}, "dir": d}


def flags(run: dict, setup: dict) -> list[str]:
    args = ["--model-name", setup["model"], "--prefill-chunk", "16" if run["chunk"] else "0",
            "--prefix-cache", "on" if run["prefix"] else "off", "--no-progress", "--num-threads", "1"]
    if run["lora"]:
        args += ["--lora", f"{ADAPTER}={setup['adapter']}"]
    if run["int8"]:
        args += ["--quantize", "int8"]
    if run["kv8"]:
        args += ["--kv-cache-dtype", "int8"]
    if run["bf16"]:
        args += ["--dtype", "bfloat16"]
    if run["invariant"]:
        args.append("--batch-invariant")
    if run["data"] > 1:
        args += ["--data-group-size", str(run["data"])]
    return args


NUMERICS = ("lora", "int8", "kv8", "bf16", "invariant")


def tolerance(run: dict) -> float:
    """Logprob tolerance against the reference: float rounding, or the rounding of int8 / bfloat16
    (a chunk or a cached prefix attends to stored keys, which int8 KV rounds; whole prompts do not)."""
    return 0.1 if run["bf16"] else 0.05 if run["int8"] or run["kv8"] else 1e-4


def reference(run: dict, setup: dict) -> list[dict]:
    """The P = 1 file-mode answers with the run's numerics, whole prompts and no prefix cache."""
    key = tuple(run[k] for k in NUMERICS)
    if key not in setup["refs"]:
        base = {**{k: v[0] for k, v in FACTORS.items()}, **dict(zip(NUMERICS, key)), "prefix": False}
        out = setup["dir"] / f"ref-{'-'.join(str(int(v)) for v in key)}.jsonl"
        assert run_inprocess([*flags(base, setup), "--infer-data", setup["files"][run["lora"]],
                              "--output-path", str(out)]) == 0
        setup["refs"][key] = read_jsonl(out)
        check_reference(setup["refs"][key], base, setup)
    return setup["refs"][key]


def check_reference(lines: list[dict], run: dict, setup: dict) -> None:
    """A float32 reference gives HF's greedy tokens and logprobs (the adapter's requests: peft's merged
    model's); a low-precision one is close to the float32 one (within its tolerance, near-ties aside)."""
    reqs = requests(run["lora"])
    if not (run["int8"] or run["kv8"] or run["bf16"]):
        tok = local_tokenizer()
        for r, x in zip(reqs, lines, strict=True):
            if r["max_tokens"] and not r.get("echo") and "n" not in r and "best_of" not in r:
                model = setup["merged"] if r.get("model") == ADAPTER else setup["model"]
                ids = tok(r["prompt"])["input_ids"]
                tokens, lps = hf_greedy(model, ids, r["max_tokens"])
                choice = x["result"]["choices"][0]
                if "stop" not in r:
                    assert choice["text"] == tok.decode(tokens, skip_special_tokens=True)
                got = choice["logprobs"]["token_logprobs"]
                assert max(abs(a - b) for a, b in zip(got, lps[: len(got)])) < 1e-4
        return
    assert_answers(lines, reference({**run, "int8": False, "kv8": False, "bf16": False}, setup), tolerance(run))


# -- comparing answers, checking effects ---------------------------------------------------------

def answers(line: dict) -> dict:
    """What a run must reproduce of a result line: choices (text, tokens, logprobs), no ids, timing,
    model name or cache figures."""
    res = strip_volatile(line)["result"]
    return {"choices": res["choices"], "completion_tokens": res["usage"]["completion_tokens"]}


def assert_answers(ours: list[dict], ref: list[dict], tol: float) -> None:
    """Choice by choice: the same tokens with logprobs within ``tol``; tokens may part only where the
    two chose tokens within ``tol`` of each other (a near-tie at this precision)."""
    assert len(ours) == len(ref)
    for i, (x, y) in enumerate(zip(ours, ref)):
        a, b = answers(x), answers(y)
        assert len(a["choices"]) == len(b["choices"]), i
        for u, v in zip(a["choices"], b["choices"]):
            lu, lv = u["logprobs"], v["logprobs"]
            d = next((k for k, (p, q) in enumerate(zip(lu["tokens"], lv["tokens"])) if p != q), None)
            n = len(lu["tokens"]) if d is None else d
            if d is None:
                assert lu["tokens"] == lv["tokens"] and u["text"] == v["text"], (i, u["text"], v["text"])
            for p, q in zip(lu["token_logprobs"][:n], lv["token_logprobs"][:n], strict=True):
                assert (p is None and q is None) or abs(p - q) <= tol, (i, p, q)
            if d is not None:
                gap = abs(lu["token_logprobs"][d] - lv["token_logprobs"][d])
                assert gap <= tol, f"line {i}: tokens part at {d} without a near-tie (gap {gap})"


def assert_effects(lines: list[dict], run: dict, summary: dict | None) -> None:
    reqs = requests(run["lora"])
    cached = [x["result"]["usage"]["prompt_tokens_details"]["cached_tokens"] for x in lines]
    if run["prefix"] and not run["invariant"]:  # the cache is on (--batch-invariant turns it off)
        assert sum(cached[i] > 0 for i in SHARED) >= len(SHARED) // 2, cached
    else:
        assert not any(cached), cached
    if summary is not None:
        assert summary["cached_prompt_tokens"] == sum(cached)
        assert summary["data_group_size"] == run["data"] and summary["pipeline_size"] == run["stages"]
        groups = summary.get("data_groups", [summary])  # several pipelines: one summary each, merged
        assert len(groups) == run["data"] and sum(g["requests"] for g in groups) == len(reqs)
        precision = [p for g in groups for p in g["stage_precision"]]
        assert len(precision) == run["stages"] * run["data"]
        for p in precision:
            assert (p["weights"] == "int8") == run["int8"], p
            assert (p.get("kv_cache") == "int8") == run["kv8"], p
            assert p["compute_dtype"] == ("bfloat16" if run["bf16"] else "float32"), p
    for r, x in zip(reqs, lines, strict=True):
        choices = x["result"]["choices"]
        assert len(choices) == r.get("n", 1)
        if r.get("echo"):  # the prompt's tokens and logprobs, then the completion's
            lp = choices[0]["logprobs"]
            assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == x["result"]["usage"]["prompt_tokens"] + r["max_tokens"]
        name = x["result"]["model"]  # what is quantized, or the adapter's name
        precision = ["int8"] * run["int8"] + ["kv-int8"] * run["kv8"]
        if r.get("model") == ADAPTER:
            assert name.startswith(ADAPTER), name
        else:
            assert name.endswith(":" + ",".join(precision)) if precision else ":" not in name, name
    full, cut = lines[-2]["result"]["choices"][0], lines[-1]["result"]["choices"][0]
    ends = [full["text"].find(s) for s in STOP if s in full["text"]]
    assert ends, "the unstopped text holds no stop string: choose others"
    assert cut["text"] == full["text"][: min(ends)] and cut["finish_reason"] == "stop"
    if run["lora"]:  # the adapter's answer to the same prompt is another one
        assert answers(lines[0]) != answers(lines[1])


# -- running --------------------------------------------------------------------------------------

def refusal(args: list[str], world: int, capsys) -> str | None:
    """The message a run of ``world`` processes is refused with before anything loads (None: it is not)."""
    from pipeline.config.options import UsageError, parse_options
    from pipeline.config.plan import make_plan

    try:
        opts = parse_options(args)
        make_plan(opts, env={"RANK": "0", "WORLD_SIZE": str(world)})
    except SystemExit:
        return capsys.readouterr().err
    except UsageError as e:
        return str(e)
    return None


@pytest.mark.parametrize("refused", list(REFUSED), ids=lambda p: "+".join(f"{k}={v}" for k, v in sorted(p)))
def test_refused_pairs_fail_before_loading_naming_both_flags(setup, refused, capsys, tmp_path):
    def args(run: dict) -> list[str]:
        where = ["--serve", str(free_port())] if run["serve"] else [
            "--infer-data", setup["files"][run["lora"]], "--output-path", str(tmp_path / "o.jsonl")]
        return flags(run, setup) + where

    run = {**{k: v[0] for k, v in FACTORS.items()}, **dict(refused)}
    message = refusal(args(run), run["stages"] * run["data"], capsys)
    assert message is not None, run
    assert all(f in message for f in REFUSED[refused]), message
    for k, v in refused:  # either flag alone is fine
        alone = {**run, k: FACTORS[k][0]}
        assert refusal(args(alone), alone["stages"] * alone["data"], capsys) is None, (k, v)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: ",".join(f"{k}={int(v)}" for k, v in r.items()))
def test_pairwise_runs_give_their_references_answers_and_show_each_feature(setup, run, tmp_path):
    ref = reference(run, setup)
    if run["serve"]:
        check_run(serve_run(run, setup, tmp_path), run, ref, None)
        return
    out = tmp_path / "out.jsonl"
    args = [*flags(run, setup), "--infer-data", setup["files"][run["lora"]], "--output-path", str(out)]
    p = run_local(args, run["stages"], data=run["data"])
    assert p.returncode == 0, p.stderr[-3000:]
    check_run(read_jsonl(out), run, ref, json.loads((tmp_path / "out.jsonl.summary.json").read_text()))


def check_run(lines: list[dict], run: dict, ref: list[dict], summary: dict | None) -> None:
    """A run's answers against its reference, and each of its features' effects."""
    if run["invariant"]:  # bit-identical whatever the layout
        assert [answers(x) for x in lines] == [answers(x) for x in ref]
    else:
        assert_answers(lines, ref, tolerance(run))
    assert_effects(lines, run, summary)


def serve_run(run: dict, setup: dict, tmp_path: Path) -> list[dict]:
    """The requests one after the other over HTTP to a server of the run's options (in this process, every
    rank a thread: tests/servers.py); result lines."""
    from tests.servers import LocalServer

    server = LocalServer(flags(run, setup), tmp_path / "server", stages=run["stages"], keys=0).start()
    try:
        return [{"request": r, "result": _post(server.url("/v1/completions"), r)} for r in requests(run["lora"])]
    finally:
        server.stop()


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())
