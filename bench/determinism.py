"""What layout changes do to sampled outputs, and what --batch-invariant costs. One command:

    python bench/determinism.py                # 5M Llama, 1000 requests (about 5 min on 2 cores)
    python bench/determinism.py --requests 200 --json /tmp/d.json

The model is bench/throughput.py's "quick" random Llama (built once, cached). The workload (fixed
seed) is 1000 requests with prompts cut from examples/corpus.txt: 80% sampled (temperature
0.7-1.0, half with top_p 0.9, half with their own seed), 20% greedy; max_tokens 16-48.

The same file runs four times at P = 1: default mode at the default budget (layout A) and at a
small budget with --max-micro-batch-size 3 (layout B, so most requests get other neighbours and
other micro-batch shapes), then --batch-invariant at both layouts. Reported: how many sampled and
greedy requests differ between layouts A and B, per 1,000 of each kind, in each mode (default mode:
float rounding decides a near-tie now and then; batch-invariant: must be 0), and generated tokens/s
of each run, with the batch-invariant / default ratio at each layout (its cost).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from throughput import PROFILES, build_model  # noqa: E402  (bench/ is a folder of scripts)

LAYOUTS = {"A": [], "B": ["--budget", "1200", "--max-micro-batch-size", "3"]}


def workload(model_dir: Path, n: int, out: Path, seed: int = 0) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.backend_tokenizer.encode((REPO / "examples" / "corpus.txt").read_text(), add_special_tokens=False).ids
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        a = rng.randrange(0, len(ids) - 200)
        req = {"prompt": tok.decode(ids[a : a + rng.randint(4, 120)]), "max_tokens": rng.randint(16, 48), "logprobs": 1}
        if rng.random() < 0.8:
            req["temperature"] = round(rng.uniform(0.7, 1.0), 2)
            if rng.random() < 0.5:
                req["top_p"] = 0.9
            if rng.random() < 0.5:
                req["seed"] = rng.randrange(1 << 30)
        else:
            req["temperature"] = 0
        lines.append(json.dumps(req))
    out.write_text("\n".join(lines) + "\n")
    return out


def run(model_dir: Path, data: Path, out: Path, flags: list[str], threads: int) -> dict:
    cmd = [sys.executable, str(REPO / "dist_inference_runner.py"), "--model-name", str(model_dir), "--infer-data",
           str(data), "--output-path", str(out), "--no-progress", "--overwrite", "--num-threads", str(threads), *flags]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"runner failed ({' '.join(flags)}):\n{p.stderr[-2000:]}")
    summary = json.loads(Path(str(out) + ".summary.json").read_text())
    texts = [[c["text"] for c in json.loads(l)["result"]["choices"]] for l in out.read_text().splitlines()]
    return {"texts": texts, "tok_s": summary["completion_tokens_per_second"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of the runner process")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    from pipeline.loading.default_model import cache_root

    model = build_model(cache_root() / "bench", PROFILES["quick"])
    work = Path(tempfile.mkdtemp(prefix="determinism-"))
    data = workload(model, args.requests, work / "work.jsonl")
    reqs = [json.loads(l) for l in data.read_text().splitlines()]
    sampled = [i for i, r in enumerate(reqs) if r["temperature"] > 0]
    greedy = [i for i, r in enumerate(reqs) if r["temperature"] == 0]
    runs = {}
    for mode, extra in (("default", []), ("batch-invariant", ["--batch-invariant"])):
        for name, flags in LAYOUTS.items():
            runs[mode, name] = run(model, data, work / f"{mode}-{name}.jsonl", flags + extra, args.threads)
    report = {"requests": len(reqs), "sampled": len(sampled), "greedy": len(greedy)}
    for mode in ("default", "batch-invariant"):
        a, b = runs[mode, "A"]["texts"], runs[mode, "B"]["texts"]
        differ = [i for i in range(len(reqs)) if a[i] != b[i]]
        report[mode] = {
            "sampled_diverged_per_1000": round(1000 * sum(i in differ for i in sampled) / max(1, len(sampled)), 1),
            "greedy_diverged_per_1000": round(1000 * sum(i in differ for i in greedy) / max(1, len(greedy)), 1),
            "tok_s": {k: runs[mode, k]["tok_s"] for k in LAYOUTS},
        }
    report["batch_invariant_speed_ratio"] = {
        k: round(runs["batch-invariant", k]["tok_s"] / runs["default", k]["tok_s"], 3) for k in LAYOUTS}
    print(f"{len(reqs)} requests ({len(sampled)} sampled, {len(greedy)} greedy), layout A = default budget, "
          f"B = {' '.join(LAYOUTS['B'])}")
    for mode in ("default", "batch-invariant"):
        r = report[mode]
        print(f"{mode:16s} diverged A vs B: sampled {r['sampled_diverged_per_1000']}/1000, greedy "
              f"{r['greedy_diverged_per_1000']}/1000; tok/s A {r['tok_s']['A']}, B {r['tok_s']['B']}")
    ratio = report["batch_invariant_speed_ratio"]
    print(f"batch-invariant speed / default: A {ratio['A']}x, B {ratio['B']}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
