"""Native Llama code against the generic transformers stage (--backend): tokens/s, memory, same outputs?

    python bench/native_vs_generic.py                          # ~50M float32 Llama, a few minutes on 2 cores
    python bench/native_vs_generic.py --layers 4 --repeats 1 --json /tmp/nvg.json

Builds a random float32 Llama locally and deterministically (hidden 512, 8 layers, vocab 32000, fixed
seed; the project's local BPE tokenizer) and two request files from a fixed seed: greedy generation
(prompts 16..128 tokens, max_tokens 32) and echo scoring (prompts 64..256 tokens, max_tokens 0),
after a one-request warm-up file (the first forward's lazy imports are not timed). Each backend
answers the files through the real runner (one process, P = 1 by default, ``--stages``
for more), alternating backends ``--repeats`` times; each figure's best run counts. Figures come from
the runner's own ``.summary.json`` (generated tokens / wall seconds of the file, scored prompt tokens /
wall seconds, the last rank's peak RSS), so process start and model load are excluded from tok/s.
The outputs are compared too: greedy tokens equal, scoring logprobs within 1e-4.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "dist_inference_runner.py"
BACKENDS = ("native", "transformers")


def build_model(out: Path, hidden: int, layers: int, intermediate: int, vocab: int, seed: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from pipeline.loading.default_model import build_tokenizer

    tok = build_tokenizer()
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                      max_position_embeddings=1024, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).eval().save_pretrained(out, max_shard_size="100MB")
    tok.save_pretrained(out)
    return out


def write_requests(work: Path, n: int, seed: int) -> dict[str, Path]:
    """Token-id prompts (ids 10..999: valid for the local tokenizer and any vocab >= 1024)."""
    rng = random.Random(seed)
    gen = [{"prompt": [rng.randrange(10, 1000) for _ in range(rng.randint(16, 128))], "max_tokens": 32,
            "temperature": 0, "logprobs": 1} for _ in range(n)]
    score = [{"prompt": [rng.randrange(10, 1000) for _ in range(rng.randint(64, 256))], "max_tokens": 0, "echo": True,
              "logprobs": 1} for _ in range(n)]
    warm = [{"prompt": [11, 12, 13], "max_tokens": 2, "temperature": 0}]  # first forward's lazy imports
    files = {}
    for kind, reqs in (("warmup", warm), ("gen", gen), ("score", score)):
        files[kind] = work / f"{kind}.jsonl"
        files[kind].write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return files


def run(model_dir: Path, files: dict[str, Path], backend: str, stages: int, work: Path, threads: int) -> dict:
    out_dir = work / f"out-{backend}-p{stages}"
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    args = ["--model-name", str(model_dir), "--infer-data", *map(str, files.values()), "--output-path", str(out_dir),
            "--backend", backend, "--no-progress", "--overwrite"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "DIST_INFER_LOG": "WARNING"}
    if stages == 1:
        cmd = [sys.executable, str(RUNNER), *args, "--num-threads", str(threads)]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(stages), "--master-addr",
               "127.0.0.1", "--master-port", str(port), str(RUNNER), *args,
               "--num-threads", str(max(1, threads // stages))]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"{backend} P={stages}: runner failed ({r.returncode}):\n{r.stderr[-4000:]}")
    res = {"backend": backend, "P": stages, "process_seconds": time.perf_counter() - t0}
    for kind, path in files.items():
        if kind == "warmup":
            continue
        out = out_dir / f"output_{path.name}"
        summary = json.loads(Path(f"{out}.summary.json").read_text())
        tokens = summary["completion_tokens"] if kind == "gen" else summary["prompt_tokens"]
        res[f"{kind}_tok_s"] = tokens / summary["wall_seconds"]
        res[f"{kind}_seconds"] = summary["wall_seconds"]
        res["peak_rss_mb"] = max(res.get("peak_rss_mb", 0), summary["last_rank_peak_rss_mb"])
        res[f"{kind}_output"] = str(out)
    return res


def best_of(runs: list[dict]) -> dict:
    """Each figure's best over the repeats (a busy machine only ever slows a run down)."""
    return {"gen_tok_s": max(r["gen_tok_s"] for r in runs), "score_tok_s": max(r["score_tok_s"] for r in runs),
            "peak_rss_mb": min(r["peak_rss_mb"] for r in runs)}


def agreement(a: dict, b: dict) -> dict:
    """Greedy tokens equal per request; largest scoring / generation logprob difference."""
    def lines(path):
        return [json.loads(x)["result"]["choices"][0]["logprobs"] for x in Path(path).read_text().splitlines()]

    gen_a, gen_b = lines(a["gen_output"]), lines(b["gen_output"])
    same = sum(x["tokens"] == y["tokens"] for x, y in zip(gen_a, gen_b))
    diff = 0.0
    for kind in ("gen", "score"):
        for x, y in zip(lines(a[f"{kind}_output"]), lines(b[f"{kind}_output"])):
            if x["tokens"] != y["tokens"]:
                continue
            diff = max([diff] + [abs(p - q) for p, q in zip(x["token_logprobs"], y["token_logprobs"]) if p is not None])
    return {"greedy_equal": same, "requests": len(gen_a), "max_logprob_diff": diff}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1376)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--requests", type=int, default=32, help="requests per file (generation and scoring)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", default="1", help="comma-separated pipeline sizes")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads in all (split among ranks)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per backend (alternating); the best counts")
    ap.add_argument("--work-dir", help="keep the model and outputs here (default: a temporary folder, removed)")
    ap.add_argument("--json", help="also write the results as JSON to this file")
    args = ap.parse_args(argv)

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="native-vs-generic-"))
    try:
        model_dir = work / f"llama-h{args.hidden}-l{args.layers}-i{args.intermediate}-v{args.vocab}-s{args.seed}"
        if not (model_dir / "config.json").is_file():
            build_model(model_dir, args.hidden, args.layers, args.intermediate, args.vocab, args.seed)
        files = write_requests(work, args.requests, args.seed)
        rows = []
        for stages in [int(x) for x in args.stages.split(",")]:
            runs: dict[str, list[dict]] = {b: [] for b in BACKENDS}
            for _ in range(args.repeats):
                for backend in BACKENDS:
                    r = run(model_dir, files, backend, stages, work, args.threads)
                    print(f"{backend} P={stages}: gen {r['gen_tok_s']:.1f} tok/s, score {r['score_tok_s']:.1f} tok/s, "
                          f"peak RSS {r['peak_rss_mb']:.0f} MB", file=sys.stderr)
                    runs[backend].append(r)
            best = {b: best_of(rs) for b, rs in runs.items()}
            nat, gen = best["native"], best["transformers"]
            rows.append({"P": stages, "native": nat, "transformers": gen, "runs": runs,
                         "agreement": agreement(runs["native"][0], runs["transformers"][0]),
                         "ratios": {k: gen[k] / nat[k] for k in ("gen_tok_s", "score_tok_s", "peak_rss_mb")}})
        report(rows, args)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def report(rows: list[dict], args) -> None:
    print(f"model: Llama hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate}, vocab "
          f"{args.vocab}, float32; {args.requests} greedy requests (max_tokens 32) + {args.requests} echo scoring")
    print(f"{'P':>2} {'backend':<13}{'gen tok/s':>10}{'score tok/s':>12}{'peak RSS MB':>12}")
    for row in rows:
        for b in BACKENDS:
            r = row[b]
            print(f"{row['P']:>2} {b:<13}{r['gen_tok_s']:>10.1f}{r['score_tok_s']:>12.1f}{r['peak_rss_mb']:>12.0f}")
        q, a = row["ratios"], row["agreement"]
        print(f"{row['P']:>2} {'generic/native':<13}{q['gen_tok_s']:>9.2f}x{q['score_tok_s']:>11.2f}x"
              f"{q['peak_rss_mb']:>11.2f}x   greedy equal {a['greedy_equal']}/{a['requests']}, "
              f"max logprob diff {a['max_logprob_diff']:.1e}")
    doc = {"model": {"hidden": args.hidden, "layers": args.layers, "intermediate": args.intermediate,
                     "vocab": args.vocab, "dtype": "float32"}, "requests": args.requests, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
