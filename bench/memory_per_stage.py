"""Peak resident memory per pipeline rank for P = 1, 2, 4: does each stage hold only its slice?

    python bench/memory_per_stage.py                      # ~900 MB float32 Llama, a few minutes on 2 cores
    python bench/memory_per_stage.py --layers 8 --stages 1,2 --json /tmp/mem.json

Builds a random float32 Llama locally and deterministically (hidden 1024, 16 layers, vocab 32000,
fixed seed; the project's local BPE tokenizer), saves it as sharded safetensors in a temporary
folder, then for each P runs ``torchrun --nproc-per-node P`` on a small request file (a few short
prompts, max_tokens 4). Each rank runs the real runner under a thin wrapper (this file with
``--rank-wrapper``) that records its peak RSS (VmHWM) when the runner exits.

Reported per rank: its layers, the bytes of the weights it owns (computed from the stage model),
its peak RSS, peak RSS minus weights (the process overhead: Python, torch, tokenizer, gloo, KV cache,
activations) and the ratio of its peak RSS to the P = 1 process.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "dist_inference_runner.py"
MB = 2**20
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,"]


def rank_wrapper(out_dir: str, runner_args: list[str]) -> None:
    """Run the runner in this process (as torchrun's script) and record this rank's peak RSS (VmHWM:
    ``ru_maxrss`` would carry torchrun's agent's own resident set across fork and exec)."""
    sys.path.insert(0, str(REPO))
    from tasks.status import peak_rss_bytes

    code = 0
    sys.argv = [str(RUNNER), *runner_args]
    try:
        runpy.run_path(str(RUNNER), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        rank = int(os.environ.get("RANK", 0))
        peak = peak_rss_bytes()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "peak_rss": peak, "exit": code}))
    sys.exit(code)


def build_model(out: Path, hidden: int, layers: int, intermediate: int, vocab: int, seed: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO))
    from pipeline.loading.default_model import build_tokenizer

    tok = build_tokenizer()
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out, max_shard_size="100MB")
    tok.save_pretrained(out)
    return out


def stage_weights(model_dir: Path, stages: int) -> list[tuple[tuple[int, int], int]]:
    """(layer range, weight bytes) of each stage, from the stage model built on the meta device."""
    import torch

    sys.path.insert(0, str(REPO))
    from pipeline.loading.stage_weights import read_config
    from pipeline.models.families import spec_from_config
    from pipeline.models.decoder import StageModel
    from pipeline.config.partition import stage_ranges

    spec = spec_from_config(read_config(model_dir))
    out = []
    for i, (a, b) in enumerate(stage_ranges(spec.num_layers, stages)):
        with torch.device("meta"):
            m = StageModel(spec, a, b, i == 0, i == stages - 1)
        out.append(((a, b), sum(p.numel() * 4 for p in m.parameters())))  # float32 on CPU
    return out


def run_pipeline(model_dir: Path, requests: Path, stages: int, work: Path) -> list[dict]:
    import socket

    rss_dir = work / f"rss-p{stages}"
    shutil.rmtree(rss_dir, ignore_errors=True)
    rss_dir.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(stages),
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           str(Path(__file__).resolve()), "--rank-wrapper", str(rss_dir), "--",
           "--model-name", str(model_dir), "--infer-data", str(requests),
           "--output-path", str(work / f"out-p{stages}.jsonl"), "--overwrite", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "DIST_INFER_LOG": "WARNING"}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        sys.exit(f"P={stages}: torchrun failed ({r.returncode}):\n{r.stderr[-4000:]}")
    ranks = [json.loads((rss_dir / f"rank{i}.json").read_text()) for i in range(stages)]
    print(f"P={stages}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return ranks


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-wrapper"]:
        rest = argv[2:]
        rank_wrapper(argv[1], rest[1:] if rest[:1] == ["--"] else rest)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", default="1,2,4", help="comma-separated pipeline sizes")
    ap.add_argument("--work-dir", help="keep the model and outputs here (default: a temporary folder, removed)")
    ap.add_argument("--json", help="also write the results as JSON to this file")
    args = ap.parse_args(argv)

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="mem-per-stage-"))
    try:
        model_dir = work / f"llama-h{args.hidden}-l{args.layers}-i{args.intermediate}-v{args.vocab}-s{args.seed}"
        if not (model_dir / "model.safetensors.index.json").is_file():
            t0 = time.perf_counter()
            build_model(model_dir, args.hidden, args.layers, args.intermediate, args.vocab, args.seed)
            print(f"built {model_dir} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        total = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        requests = work / "requests.jsonl"
        requests.write_text("".join(json.dumps({"prompt": p, "max_tokens": 4, "temperature": 0}) + "\n" for p in PROMPTS))
        rows = []
        for stages in [int(x) for x in args.stages.split(",")]:
            ranks = run_pipeline(model_dir, requests, stages, work)
            for (layers, weights), r in zip(stage_weights(model_dir, stages), ranks):
                rows.append({"P": stages, "rank": r["rank"], "layers": list(layers), "weights_mb": weights / MB,
                             "peak_rss_mb": r["peak_rss"] / MB})
        base = next((r["peak_rss_mb"] for r in rows if r["P"] == 1), None)
        for r in rows:
            r["overhead_mb"] = r["peak_rss_mb"] - r["weights_mb"]
            r["ratio_to_p1"] = r["peak_rss_mb"] / base if base else None
        report(rows, total, args)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def report(rows: list[dict], total: int, args) -> None:
    print(f"model: Llama hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate}, "
          f"vocab {args.vocab}, float32, {total / MB:.0f} MB of sharded safetensors; 4 prompts, max_tokens 4")
    print(f"{'P':>2} {'rank':>4} {'layers':>9} {'weights MB':>11} {'peak RSS MB':>12} {'RSS-weights':>12} {'ratio to P=1':>13}")
    for r in rows:
        ratio = f"{r['ratio_to_p1']:.2f}" if r["ratio_to_p1"] is not None else "-"
        print(f"{r['P']:>2} {r['rank']:>4} {'[%d, %d)' % tuple(r['layers']):>9} {r['weights_mb']:>11.0f} "
              f"{r['peak_rss_mb']:>12.0f} {r['overhead_mb']:>12.0f} {ratio:>13}")
    doc = {"model": {"hidden": args.hidden, "layers": args.layers, "intermediate": args.intermediate,
                     "vocab": args.vocab, "dtype": "float32", "checkpoint_mb": total / MB}, "rows": rows}
    print(json.dumps(doc, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
