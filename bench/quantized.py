"""A GPTQ int4 checkpoint against the same model in bfloat16 and under ``--quantize int8``:
generated tokens/s and peak resident memory per stage, one run each, on this machine's CPU.

    python bench/quantized.py                              # hidden 1024, 8 layers; ~10 min on 2 busy cores
    python bench/quantized.py --layers 4 --stages 1 --json /tmp/q.json

Builds a random float32 Llama (fixed seed, the project's local BPE tokenizer), packs its decoder
projections as GPTQ int4 (groups of 128, symmetric; tests/quant_checkpoints.py writes AutoGPTQ's
layout), then runs the real runner under torchrun (``--stages`` ranks, one thread each) on the same
greedy requests for every system; each rank's peak RSS is recorded by bench/memory_per_stage.py's
rank wrapper. Ratios are against bfloat16 in the same run. The int4 runs report the kernel each
stage chose (timed at load: dequantize vs torch's packed int4 kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.machine import cpu_name  # noqa: E402
from bench.memory_per_stage import build_model  # noqa: E402
from tests.quant_checkpoints import gptq  # noqa: E402

RUNNER = REPO / "dist_inference_runner.py"
WRAPPER = REPO / "bench" / "memory_per_stage.py"
SYSTEMS = {"bf16": ("float", ["--dtype", "bfloat16"]), "int8": ("float", ["--quantize", "int8"]),
           "gptq-int4": ("gptq", []), "gptq-int4-bf16": ("gptq", ["--dtype", "bfloat16"])}
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,",
           "In the beginning", "The quick brown fox", "Dear Sir or Madam,", "Translate to French:"]


def run(model: Path, flags: list[str], stages: int, requests: Path, work: Path) -> dict:
    rss = work / "rss"
    shutil.rmtree(rss, ignore_errors=True)
    rss.mkdir(parents=True)
    out = work / "out.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(stages), "--master-addr",
           "127.0.0.1", "--master-port", str(29500 + os.getpid() % 1000), str(WRAPPER), "--rank-wrapper", str(rss),
           "--", "--model-name", str(model), "--infer-data", str(requests), "--output-path", str(out),
           "--overwrite", "--no-progress", "--num-threads", "1", *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=os.environ | {"OMP_NUM_THREADS": "1"})
    if r.returncode:
        sys.exit(f"{' '.join(flags)}: runner failed ({r.returncode}):\n{r.stderr[-4000:]}")
    summary = json.loads(Path(f"{out}.summary.json").read_text())
    peaks = [json.loads((rss / f"rank{i}.json").read_text())["peak_rss"] / 2**20 for i in range(stages)]
    return {"tokens_per_s": summary["completion_tokens_per_second"], "completion_tokens": summary["completion_tokens"],
            "peak_rss_mb": [round(p) for p in peaks], "precision": summary["stage_precision"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-quantized-"))
    try:
        inter = -(-args.hidden * 11 // 4 // 128) * 128  # whole groups of 128
        floats = build_model(work / "float", args.hidden, args.layers, inter, 32000, seed=0)
        packed, _ = gptq(floats, work / "gptq", work / "gptq-ref", bits=4, group=128)
        requests = work / "req.jsonl"
        requests.write_text("".join(json.dumps({"prompt": p, "max_tokens": args.max_tokens, "temperature": 0}) + "\n"
                                    for p in PROMPTS))
        models = {"float": floats, "gptq": Path(packed)}
        results = {name: run(models[kind], flags, args.stages, requests, work) for name, (kind, flags) in SYSTEMS.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"CPU: {cpu_name()}; Llama hidden {args.hidden}, {args.layers} layers, vocab 32000; "
          f"P = {args.stages}, 1 thread per rank; {len(PROMPTS)} greedy requests x {args.max_tokens} tokens")
    base = results["bf16"]
    print(f"{'system':16} {'tok/s':>8} {'x bf16':>7}  peak RSS per stage MB (x bf16)   kernels")
    for name, r in results.items():
        ratio = r["tokens_per_s"] / base["tokens_per_s"]
        mem = ", ".join(f"{p} ({p / b:.2f})" for p, b in zip(r["peak_rss_mb"], base["peak_rss_mb"]))
        kernels = "; ".join("+".join(sorted(set(s.get("kernels", {}).values()))) or s["weights"] for s in r["precision"])
        print(f"{name:16} {r['tokens_per_s']:8.1f} {ratio:7.2f}  {mem:30}  {kernels}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "args": vars(args) | {"json": str(args.json)}, "results": results},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
