"""LoRA adapters mixed in one run against the base model alone: throughput ratio (target >= 0.8x).

    python bench/lora.py               # throughput.py's ~100M Llama, its 205 generation requests (~10 min on 2 cores)
    python bench/lora.py --quick       # its 5M Llama, 38 requests (about a minute)
    python bench/lora.py --pipeline 2  # the same under torchrun, P = 2

Both runs answer the same generation requests (bench/throughput.py's gen.jsonl: prompts of 8..512
tokens from examples/corpus.txt, greedy, max_tokens 1..128, some stop strings):

- ``base``: the runner without adapters, requests without ``model``;
- ``mixed``: the runner with ``--lora a0=... --lora a3=...`` and request i naming adapter ``a{i % 4}``,
  so every micro-batch mixes four adapters.

The adapters are random PEFT folders written here (``adapter_config.json`` +
``adapter_model.safetensors``, rank ``--rank`` on every projection: q, k, v, o, gate, up, down, the
heaviest common choice), so the bench needs no peft. Figures: generated tokens/s of each run from
the runner's summary line, their ratio (mixed / base), and how many answers the adapters changed
(they must change some: random factors that left every answer alone would measure nothing). On a
machine shared with other work the wall-clock ratio follows the others' load; the ratio of generated
tokens per CPU second of each run (``getrusage`` of the finished runner processes) does not.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.throughput import PROFILES, build_model, build_workload, free_port  # noqa: E402

ADAPTERS = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder with random A and B on every projection of every layer."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * (h // cfg["num_attention_heads"])
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h), "gate_proj": (h, inter),
              "up_proj": (h, inter), "down_proj": (inter, h)}  # (in, out)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for name, (n_in, n_out) in shapes.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS,
        "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": str(model_dir)}))
    return out


def run(model_dir: Path, src: Path, out: Path, pipeline: int, cores: int, extra: list[str]) -> dict:
    threads = max(1, cores // pipeline)
    args = [str(REPO / "dist_inference_runner.py"), "--model-name", str(model_dir), "--infer-data", str(src),
            "--output-path", str(out), "--num-threads", str(threads), "--no-progress", "--overwrite", *extra]
    cmd = [sys.executable, *args] if pipeline == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(pipeline), "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), *args]
    t0, cpu0 = time.perf_counter(), _children_cpu()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=7200, check=False)
    cpu = _children_cpu() - cpu0
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    g = re.search(r"(\d+) prompt \+ (\d+) generated tokens in ([\d.]+)s", res.stderr)
    gen, secs = int(g.group(2)), float(g.group(3))
    texts = [json.loads(line)["result"]["choices"][0]["text"] for line in out.read_text().splitlines()]
    return {"generated_tokens": gen, "seconds": secs, "tokens_per_s": gen / secs, "wall": time.perf_counter() - t0,
            "cpu_seconds": cpu, "tokens_per_cpu_s": gen / cpu, "command": " ".join(cmd), "texts": texts}


def _children_cpu() -> float:
    """User + system CPU seconds of finished child processes (torchrun's workers included)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 5M model and 38 requests")
    ap.add_argument("--requests", type=int, default=0, help="override the profile's request count")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank of every adapter")
    ap.add_argument("--pipeline", type=int, default=1, help="pipeline stages (torchrun for 2+)")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="alternate base and mixed runs this many times; "
                    "report each one's fastest (a shared machine's load varies between runs)")
    ap.add_argument("--work-dir", default=str(Path.home() / ".cache" / "dist-inference-runner" / "bench-lora"))
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    prof = dict(PROFILES["quick" if args.quick else "full"])
    if args.requests:
        prof["requests"] = args.requests
    wdir = Path(args.work_dir)
    model_dir = build_model(wdir.parent / "bench", prof)
    build_workload(model_dir, prof, wdir)
    base_lines = [json.loads(line) for line in (wdir / "gen.jsonl").read_text().splitlines()]
    mixed = wdir / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(dict(b, model=f"a{i % ADAPTERS}")) + "\n" for i, b in enumerate(base_lines)))
    flags = []
    for k in range(ADAPTERS):
        flags += ["--lora", f"a{k}={write_adapter(model_dir, wdir / f'a{k}', args.rank, seed=k)}"]
    bases, mixes = [], []
    for _ in range(args.repeat):
        bases.append(run(model_dir, wdir / "gen.jsonl", wdir / "out_base.jsonl", args.pipeline, args.cores, []))
        mixes.append(run(model_dir, mixed, wdir / "out_mixed.jsonl", args.pipeline, args.cores, flags))
    base = max(bases, key=lambda r: r["tokens_per_s"])
    mix = max(mixes, key=lambda r: r["tokens_per_s"])
    changed = sum(a != b for a, b in zip(base.pop("texts"), mix.pop("texts")))
    ratio = mix["tokens_per_s"] / base["tokens_per_s"]
    cpu_ratio = mix["tokens_per_cpu_s"] / base["tokens_per_cpu_s"]
    base["all_tokens_per_s"] = [round(r["tokens_per_s"], 2) for r in bases]
    mix["all_tokens_per_s"] = [round(r["tokens_per_s"], 2) for r in mixes]
    out = {"model": str(model_dir), "requests": len(base_lines), "adapters": ADAPTERS, "rank": args.rank,
           "pipeline": args.pipeline, "base": base, "mixed": mix, "ratio": ratio, "changed_answers": changed, "cpu_ratio": cpu_ratio,
           "target": {"mixed / base": 0.8, "met": ratio >= 0.8}}
    print(f"{len(base_lines)} requests, P = {args.pipeline}, {ADAPTERS} adapters of rank {args.rank} on every projection")
    print(f"  base only      {base['tokens_per_s']:8.1f} generated tok/s ({base['generated_tokens']} tokens in {base['seconds']:.1f}s)")
    print(f"  4 adapters mix {mix['tokens_per_s']:8.1f} generated tok/s ({mix['generated_tokens']} tokens in {mix['seconds']:.1f}s)")
    print(f"  per CPU second (load and startup included, robust to other processes): base "
          f"{base['tokens_per_cpu_s']:.2f}, mixed {mix['tokens_per_cpu_s']:.2f} generated tokens: {cpu_ratio:.2f}x")
    if args.repeat > 1:
        print(f"  (fastest of {args.repeat} alternating runs each: base {base['all_tokens_per_s']}, "
              f"mixed {mix['all_tokens_per_s']})")
    print(f"  ratio mixed / base: {ratio:.2f}x (target >= 0.8x: {'met' if ratio >= 0.8 else 'NOT met'}); "
          f"adapters changed {changed} of {len(base_lines)} answers")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if changed else 1


if __name__ == "__main__":
    sys.exit(main())
