"""Prefix cache on versus off (and HF) on two workloads that share prefixes, built locally.

    python bench/prefix_cache.py               # hidden 512 x 8 layers Llama, ~5 min on 2 cores
    python bench/prefix_cache.py --quick       # the throughput benchmark's 5M Llama, ~1 min
    python bench/prefix_cache.py --mixed       # also: the cost of the cache on a file that shares nothing
    python bench/prefix_cache.py --systems runner2,runner3 --prefix-tokens 600 --questions 24
                                               # default flags (chunked prefill at P > 1) against cache off

- **few-shot generation** (``gen.jsonl``): one few-shot prefix of about 1k tokens (``--prefix-tokens``;
  bAbI-style passages with answers) before each of N short questions (``--questions``), greedy,
  ``max_tokens`` 8;
- **multiple-choice scoring** (``score.jsonl``): contexts of ~150 tokens with 4 continuations each,
  every continuation its own echo-scoring request (``echo: true, max_tokens: 0, logprobs: 1``, as
  lm-eval sends them), interleaved (continuation j of every context, then j + 1).

Systems (each in its own process, one after the other, through bench/throughput.py's runner):
``hf`` (generate in batches of 32 / a plain forward), the runner at P = 1, 2 or 3 (``runner1``,
``runner2``, ``runner3``) with ``--prefix-cache off`` and ``on``, every other flag at its default (so
at P > 1 with chunked prefill). Figures: generated tokens/s on the few-shot file, scored prompt
tokens/s on the multiple-choice file (the runner's own per-file summary lines; HF times its loops),
the ratio cache on / off, and whether the answers agree (greedy text equal, logprobs within 1e-3).

``--mixed`` adds the throughput benchmark's mixed workload (random corpus slices of log-uniform
length, generation and echo scoring: no prompt shares a block with another), run with the cache off
and on, alternately, ``--repeat`` times each (best time kept): the cost of the cache when it finds
nothing to reuse (digests, bookkeeping, the spare column).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.throughput import build_model, run_system  # noqa: E402
from bench.throughput import build_workload as build_mixed  # noqa: E402

PROFILES = {
    "full": dict(hidden=512, layers=8, heads=8, intermediate=1376, questions=48, contexts=24,
                 requests=96, max_prompt=512, max_tokens=64),
    "quick": dict(hidden=256, layers=4, heads=8, intermediate=688, questions=32, contexts=16,
                  requests=48, max_prompt=256, max_tokens=32),
}
ROOMS = ["kitchen", "garden", "office", "hallway", "bedroom", "bathroom", "cellar", "attic"]
DIRS = ["north", "south", "east", "west"]


def passage(rng: random.Random) -> str:
    a, b, c = rng.sample(ROOMS, 3)
    d1, d2 = rng.choice(DIRS), rng.choice(DIRS)
    return (f"Passage: The {a} is {d1} of the {b}.\nThe {b} is {d2} of the {c}.\n"
            f"Question: How do you go from the {c} to the {a}?\nAnswer: {d1} {d2}\n\n")


def build_workload(wdir: Path, prof: dict, tok) -> dict:
    rng = random.Random(7)
    shots = ""
    while len(tok(shots)["input_ids"]) < prof.get("prefix_tokens", 1000):
        shots += passage(rng)
    gen = []
    for _ in range(prof["questions"]):
        a, b = rng.sample(ROOMS, 2)
        gen.append({"prompt": shots + f"Passage: The {a} is {rng.choice(DIRS)} of the {b}.\n"
                              f"Question: How do you go from the {b} to the {a}?\nAnswer:",
                    "max_tokens": 8, "temperature": 0})
    contexts = []
    for _ in range(prof["contexts"]):
        ctx = ""
        while len(tok(ctx)["input_ids"]) < 150:
            ctx += passage(rng)
        contexts.append(ctx + "Question: Which way is the garden from the office?\nAnswer:")
    score = [{"prompt": ctx + f" {d} of the {ROOMS[j]}", "max_tokens": 0, "echo": True, "logprobs": 1}
             for j, d in enumerate(DIRS) for ctx in contexts]
    wdir.mkdir(parents=True, exist_ok=True)
    for name, lines in (("gen", gen), ("score", score)):
        (wdir / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return {"prefix_tokens": len(tok(shots)["input_ids"]), "questions": len(gen), "scoring_requests": len(score)}


def rates(m: dict) -> dict:
    s = m.get("summary_lines") or {}
    gen = s.get("gen", {}).get("generated_tokens") if s else sum(r["generated"] for r in m.get("gen", []) if r)
    scored = sum(r["tokens"] for r in m.get("score", []) if r)
    if s:
        gen = s["gen"]["generated_tokens"]
    return {"gen_tok_s": round(gen / m["gen_s"], 2) if m.get("gen_s") else None,
            "score_tok_s": round(scored / m["score_s"], 2) if m.get("score_s") else None,
            "gen_s": round(m["gen_s"], 2), "score_s": round(m["score_s"], 2)}


def agree(a: dict, b: dict) -> dict:
    texts = sum(x is not None and y is not None and x.get("text") == y.get("text") for x, y in zip(a["gen"], b["gen"]))
    close = sum(x is not None and y is not None and len(x["logprobs"]) == len(y["logprobs"]) and
                all(abs(u - v) < 1e-3 for u, v in zip(x["logprobs"], y["logprobs"]))
                for x, y in zip(a["score"], b["score"]))
    return {"gen_text_equal": f"{texts}/{len(b['gen'])}", "score_logprobs_close": f"{close}/{len(b['score'])}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the 5M Llama and fewer requests")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--systems", default="hf,runner1,runner2")
    ap.add_argument("--json", default=None, help="write all figures here")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--mixed", action="store_true", help="also the mixed workload without shared prefixes")
    ap.add_argument("--repeat", type=int, default=2, help="runs per mode on the mixed workload (best kept)")
    ap.add_argument("--prefix-tokens", type=int, default=1000, help="tokens of the few-shot prefix (about)")
    ap.add_argument("--questions", type=int, default=None, help="few-shot questions (default: the profile's)")
    args = ap.parse_args(argv)
    from pipeline.loading.default_model import build_tokenizer, cache_root

    profile = "quick" if args.quick else "full"
    prof = dict(PROFILES[profile], prefix_tokens=args.prefix_tokens)
    if args.questions:
        prof["questions"] = args.questions
    model_dir = build_model(cache_root() / "bench", dict(prof))
    wdir = REPO / "bench" / "results" / f"prefix-{profile}-{args.prefix_tokens}x{prof['questions']}"
    info = build_workload(wdir, prof, build_tokenizer())
    print(f"[bench] model {model_dir}; workload {info}", file=sys.stderr)
    results = {}
    for system in args.systems.split(","):
        for mode in (("off", "on") if system.startswith("runner") else (None,)):
            label = system if mode is None else f"{system}-{mode}"
            extra = [] if mode is None else ["--prefix-cache", mode]
            t0 = time.perf_counter()
            m = run_system(system, model_dir, wdir, args.cores, args.timeout, extra, label=label)
            if m.get("error"):
                print(f"[bench] {label} failed: {m['error']}\n{m.get('log_tail', '')}", file=sys.stderr)
                return 1
            results[label] = m
            print(f"[bench] {label}: {rates(m)} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
    rows = {k: rates(m) for k, m in results.items()}
    print(f"\nprefix cache, {profile} profile: hidden {prof['hidden']} x {prof['layers']} layers; few-shot prefix "
          f"{info['prefix_tokens']} tokens x {info['questions']} questions; {info['scoring_requests']} "
          f"multiple-choice scoring requests; {args.cores} cores\n")
    print(f"{'system':<14}{'gen tok/s':>11}{'scored tok/s':>14}")
    for k, r in rows.items():
        print(f"{k:<14}{r['gen_tok_s'] or 0:>11.1f}{r['score_tok_s'] or 0:>14.1f}")
    summary = {}
    for p in [s for s in args.systems.split(",") if s.startswith("runner")]:
        if f"{p}-on" in rows:
            on, off = rows[f"{p}-on"], rows[f"{p}-off"]
            summary[p] = {"few-shot gen on/off": round(on["gen_tok_s"] / off["gen_tok_s"], 2),
                          "mc scoring on/off": round(on["score_tok_s"] / off["score_tok_s"], 2),
                          **agree(results[f"{p}-on"], results[f"{p}-off"])}
            if "hf" in rows:
                summary[p]["few-shot gen on/hf"] = round(on["gen_tok_s"] / rows["hf"]["gen_tok_s"], 2)
                summary[p]["mc scoring on/hf"] = round(on["score_tok_s"] / rows["hf"]["score_tok_s"], 2)
    print()
    for p, s in summary.items():
        print(f"{p}: " + ", ".join(f"{k} {v}" for k, v in s.items()))
    mixed = mixed_cost(model_dir, prof, profile, args) if args.mixed else None
    if mixed is None and args.mixed:
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": profile, "workload": info, "rates": rows,
                                               "ratios": summary, "mixed": mixed}, indent=1))
    return 0


def mixed_cost(model_dir: Path, prof: dict, profile: str, args) -> dict | None:
    """Cache on / off on a workload that shares no prefix, per pipeline size: best of ``--repeat``."""
    wdir = REPO / "bench" / "results" / f"prefix-{profile}-mixed"
    build_mixed(model_dir, prof, wdir)
    out = {}
    for system in [s for s in args.systems.split(",") if s.startswith("runner")]:
        best: dict[str, dict] = {}
        for _ in range(args.repeat):
            for mode in ("off", "on"):
                m = run_system(system, model_dir, wdir, args.cores, args.timeout, ["--prefix-cache", mode],
                               label=f"{system}-{mode}")
                if m.get("error"):
                    print(f"[bench] mixed {system}-{mode} failed: {m['error']}\n{m.get('log_tail', '')}", file=sys.stderr)
                    return None
                r = rates(m)
                r["seconds"] = m["gen_s"] + m["score_s"]
                if mode not in best or r["seconds"] < best[mode]["seconds"]:
                    best[mode] = r
        on, off = best["on"], best["off"]
        out[system] = {"off": off, "on": on, "gen on/off": round(on["gen_tok_s"] / off["gen_tok_s"], 3),
                       "scoring on/off": round(on["score_tok_s"] / off["score_tok_s"], 3),
                       "time off/on": round(off["seconds"] / on["seconds"], 3)}
        print(f"mixed workload (no shared prefix), {system}: gen on/off {out[system]['gen on/off']}, scoring on/off "
              f"{out[system]['scoring on/off']}, time off/on {out[system]['time off/on']} (best of {args.repeat})")
    return out


if __name__ == "__main__":
    sys.exit(main())
