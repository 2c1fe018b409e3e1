"""Real-size checkpoints on the machine you have: peak RSS per stage against its weights, load speed
against the disk's, time to first token and decode speed against the memory-bandwidth bound.

    python bench/real_size.py --model small --stages 1,2            # 1.1 GB, a few minutes (smoke)
    python bench/real_size.py --model 3b --stages 1,2               # Llama-3.2-3B shapes, 6.4 GB bf16
    python bench/real_size.py --model 8b --stages 2 --check-p1      # Llama-3.1-8B shapes, 16 GB; P = 1 too
    python bench/real_size.py --model 3b --stages 1,2 --load-only float32  # only each stage's loading

Builds the checkpoint once (random bf16 weights with the real shapes and 2 GB shards, written tensor
by tensor, so building never holds the whole model; the project's local tokenizer) under
``$DIST_INFER_CACHE/real-size``. Then, per P: ``torchrun --nproc-per-node P`` runs the real runner
with ``--dtype bfloat16`` on a few prompts (each rank under bench/memory_per_stage.py's wrapper,
which records its peak RSS). Reported per rank: layers, weight bytes, peak RSS and the ratio; per
run: load seconds per stage (the runner's log line after the stage's weights are in place: building
the empty stage and reading its tensors, before any kernel choice or packing) and GB/s against a
plain sequential read of the same shards just before (16 MiB reads into one reused buffer; page
cache as it is, then again: the second read sees the cache as the stages will, and the loads are
compared with it), with their ratio, time from launch to the first result line,
generated tokens/s and the bound ``bandwidth / bytes of weights read per decode pass`` (bandwidth from
a large tensor copy). ``--check-p1`` also runs P = 1: the memory check refuses it (exit 2, with the numbers) when it cannot
fit the node's available memory, or lets it run (then its peak RSS is reported).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.memory_per_stage import MB, PROMPTS  # noqa: E402
from pipeline.paths import cache_root  # noqa: E402

GB = 1e9
SHAPES = {  # Llama-3.x shapes (vocab 128,256); small: the same vocab on a 1B-class body, for a smoke run;
    # 1b: TinyLlama-1.1B's (vocab 32,000, untied), the shape bench/llamacpp.py compares at
    "small": dict(hidden=2048, layers=8, intermediate=5632, heads=32, kv_heads=8, tied=True),
    "1b": dict(hidden=2048, layers=22, intermediate=5632, heads=32, kv_heads=4, tied=False, vocab=32000),
    "3b": dict(hidden=3072, layers=28, intermediate=8192, heads=24, kv_heads=8, tied=True),
    "8b": dict(hidden=4096, layers=32, intermediate=14336, heads=32, kv_heads=8, tied=False),
}
VOCAB = 128256
SHARD = 2 * 10**9


def tensors(shape: dict):
    """(name, shape) of every tensor of a Llama checkpoint, in file order."""
    h, i, L = shape["hidden"], shape["intermediate"], shape["layers"]
    kv, vocab = shape["kv_heads"] * h // shape["heads"], shape.get("vocab", VOCAB)
    yield "model.embed_tokens.weight", (vocab, h)
    for n in range(L):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (h, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, h)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (i, h)
        yield p + "mlp.up_proj.weight", (i, h)
        yield p + "mlp.down_proj.weight", (h, i)
    yield "model.norm.weight", (h,)
    if not shape["tied"]:
        yield "lm_head.weight", (vocab, h)


def build(out: Path, shape: dict) -> None:
    """config.json, tokenizer and sharded bf16 safetensors, one shard in memory at a time."""
    import torch
    from safetensors.torch import save_file

    from pipeline.loading.default_model import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save_pretrained(out)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape["hidden"],
           "intermediate_size": shape["intermediate"], "num_hidden_layers": shape["layers"],
           "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv_heads"],
           "vocab_size": shape.get("vocab", VOCAB),
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
           "tie_word_embeddings": shape["tied"], "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
           "hidden_act": "silu"}
    gen = torch.Generator().manual_seed(0)
    shards, current, size, weight_map = [], {}, 0, {}

    def flush():
        nonlocal current, size
        if current:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(current, str(out / name), metadata={"format": "pt"})
            shards.append(name)
            weight_map.update({k: name for k in current})
            current, size = {}, 0

    for name, dims in tensors(shape):
        t = torch.ones(dims, dtype=torch.bfloat16) if len(dims) == 1 else \
            (torch.randn(dims, generator=gen) * 0.02).to(torch.bfloat16)
        if size + t.numel() * 2 > SHARD:
            flush()
        current[name], size = t, size + t.numel() * 2
    flush()
    total = sum((out / s).stat().st_size for s in shards)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


def read_speed(model_dir: Path) -> float:
    """GB/s of a plain sequential read of every shard (16 MiB reads)."""
    t0, n = time.perf_counter(), 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(16 << 20):
                n += len(chunk)
    return n / GB / (time.perf_counter() - t0)


def bandwidth() -> float:
    """GB/s of a 1 GiB tensor copy (read + write), the decode bound's denominator."""
    import torch

    a = torch.empty(1 << 28, dtype=torch.float32).fill_(1)
    b = torch.empty_like(a)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(3):
        b.copy_(a)
    return 3 * 2 * a.numel() * 4 / GB / (time.perf_counter() - t0)


def run(model_dir: Path, stages: int, work: Path, max_tokens: int) -> dict:
    """One torchrun of the runner; its exit code, per-rank peak RSS, load times, first-result time."""
    rss_dir = work / f"rss-p{stages}"
    rss_dir.mkdir(parents=True, exist_ok=True)
    for f in rss_dir.glob("*.json"):
        f.unlink()
    requests = work / "requests.jsonl"
    requests.write_text("".join(json.dumps({"prompt": p, "max_tokens": max_tokens, "temperature": 0}) + "\n"
                                for p in PROMPTS))
    out = work / f"out-p{stages}.jsonl"
    for old in (out, out.with_name(out.name + ".partial"), out.with_name(out.name + ".summary.json")):
        old.unlink(missing_ok=True)  # the watcher below must not see an earlier run's output
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(stages), "--master-addr",
           "127.0.0.1", "--master-port", str(port), str(REPO / "bench" / "memory_per_stage.py"), "--rank-wrapper",
           str(rss_dir), "--", "--model-name", str(model_dir), "--infer-data", str(requests), "--output-path",
           str(out), "--overwrite", "--no-progress", "--dtype", "bfloat16"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "DIST_INFER_LOG": "INFO"}
    first: list[float] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def watch():  # the first result line in the journal (or the output): time to first token, and more
        journal = out.with_name(out.name + ".partial")
        while proc.poll() is None and not first:
            if (journal.exists() and journal.stat().st_size) or out.exists():
                first.append(time.perf_counter() - t0)
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    _, err = proc.communicate(timeout=3600)
    wall = time.perf_counter() - t0
    loads = [float(x) for x in re.findall(r"stage \d+/\d+: layers \[\d+, \d+\), \d+ tensors, ([\d.]+)s", err)]
    ranks = [json.loads(f.read_text()) for f in sorted(rss_dir.glob("rank*.json"))]
    summary = {}
    if proc.returncode == 0:
        summary = json.loads(out.with_name(out.name + ".summary.json").read_text())
    return {"P": stages, "exit": proc.returncode, "wall_s": wall, "first_result_s": first[0] if first else None,
            "load_s": loads, "ranks": ranks, "summary": summary, "stderr_tail": err[-1500:]}


_LOAD_ONE = """
import json, sys, time
import torch
import dist_inference_runner  # the runner's imports, so only the loading is timed
from pipeline.config.partition import stage_ranges
from pipeline.loading.stage_weights import build_stage
from pipeline.runtime.host_memory import keep_freed_memory
model_dir, stages, stage, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), getattr(torch, sys.argv[4])
keep_freed_memory()  # as a CPU stage of the runner does
torch.set_num_threads(max(1, torch.get_num_threads() // stages))
a, b = stage_ranges(json.load(open(model_dir + "/config.json"))["num_hidden_layers"], stages)[stage]
t0 = time.perf_counter()
build_stage(model_dir, a, b, stage == 0, stage == stages - 1, dtype)
load_s = time.perf_counter() - t0
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))  # ru_maxrss survives exec
print(json.dumps({"load_s": load_s, "peak_rss": int(hwm.split()[1]) * 1024}))
"""


def load_only(model_dir: Path, stages: int, dtype: str) -> list[dict]:
    """Each stage of a P-stage plan loaded alone in a fresh process (one after the other: no
    contention between them): its build_stage seconds and the process's peak RSS."""
    out = []
    for stage in range(stages):
        res = subprocess.run([sys.executable, "-c", _LOAD_ONE, str(model_dir), str(stages), str(stage), dtype],
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                             timeout=3600, check=True)
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


def stage_bytes(model_dir: Path, stages: int) -> list[int]:
    """Weight bytes each stage reads (bf16 as stored), from the index and the plan's even split."""
    from pipeline.config.partition import stage_ranges

    cfg = json.loads((model_dir / "config.json").read_text())
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    shape = {"hidden": cfg["hidden_size"], "intermediate": cfg["intermediate_size"], "layers": cfg["num_hidden_layers"],
             "heads": cfg["num_attention_heads"], "kv_heads": cfg["num_key_value_heads"],
             "tied": cfg["tie_word_embeddings"], "vocab": cfg["vocab_size"]}
    sizes = {n: 2 * math.prod(d) for n, d in tensors(shape)}
    assert set(sizes) == set(index)
    out = []
    for s, (a, b) in enumerate(stage_ranges(shape["layers"], stages)):
        own = [n for n in sizes if n.startswith("model.layers.") and a <= int(n.split(".")[2]) < b]
        if s == 0:
            own.append("model.embed_tokens.weight")
        if s == stages - 1:
            own += ["model.norm.weight", "lm_head.weight" if not shape["tied"] else "model.embed_tokens.weight"]
        out.append(sum(sizes[n] for n in set(own)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="small")
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--check-p1", action="store_true", help="also run P = 1: refused by the memory check, or run")
    ap.add_argument("--load-only", metavar="DTYPE", choices=("bfloat16", "float32"),
                    help="only load each stage alone in a fresh process (no run) in this dtype: seconds, GB/s, peak RSS")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    model_dir = cache_root() / "real-size" / f"llama-{args.model}"
    if not (model_dir / "config.json").is_file():
        t0 = time.perf_counter()
        build(model_dir, SHAPES[args.model])
        print(f"built {model_dir} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    total = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    first_read = read_speed(model_dir)  # from the disk, or from the page cache if the shards are there
    disk, bw = read_speed(model_dir), bandwidth()  # the page cache as the stages will find it
    print(f"model {args.model}: {total / GB:.2f} GB bf16; sequential read {first_read:.2f} GB/s, again {disk:.2f} "
          f"GB/s (the loads below are compared with the second); copy bandwidth {bw:.1f} GB/s")
    results = []
    if args.load_only:
        for stages in [int(x) for x in args.stages.split(",")]:
            for stage, (r, w) in enumerate(zip(load_only(model_dir, stages, args.load_only),
                                               stage_bytes(model_dir, stages))):
                speed = w / GB / r["load_s"]
                print(f"P={stages} stage {stage} alone, --dtype {args.load_only}: {w / MB:.0f} MB stored, load "
                      f"{r['load_s']:.2f} s ({speed:.2f} GB/s, {speed / disk:.2f}x the sequential read), "
                      f"peak RSS {r['peak_rss'] / MB:.0f} MB")
                results.append({"P": stages, "stage": stage, "dtype": args.load_only, **r})
        return _write(args.json, args.model, first_read, disk, bw, results)
    if args.check_p1:
        r = run(model_dir, 1, model_dir.parent / "work", args.max_tokens)
        refused = r["exit"] == 2 and "does not fit" in r["stderr_tail"]
        if refused:
            print("P=1: refused before loading by the memory check:\n" + r["stderr_tail"].strip().splitlines()[-1])
        elif r["exit"] == 0:
            peak = r["ranks"][0]["peak_rss"] if r["ranks"] else 0
            print(f"P=1: the memory check let it run, and it ran: peak RSS {peak / MB:.0f} MB for "
                  f"{stage_bytes(model_dir, 1)[0] / MB:.0f} MB of weights")
        else:
            print(f"P=1: exit {r['exit']} (neither refused by the check nor finished):\n{r['stderr_tail']}")
        results.append(r)
    for stages in [int(x) for x in args.stages.split(",")]:
        r = run(model_dir, stages, model_dir.parent / "work", args.max_tokens)
        results.append(r)
        if r["exit"] != 0:
            print(f"P={stages}: exit {r['exit']}\n{r['stderr_tail']}")
            continue
        weights = stage_bytes(model_dir, stages)
        tok_s = r["summary"].get("completion_tokens_per_second") or 0
        bound = bw * GB / sum(weights)  # every decode pass reads every weight once
        s = r["summary"]
        ttft = f" ({s['startup_seconds'] + s['first_result_seconds']:.1f} s in the summary)" \
            if s.get("startup_seconds") is not None and s.get("first_result_seconds") is not None else ""
        print(f"P={stages}: first result {r['first_result_s'] or float('nan'):.1f} s after launch{ttft}, {tok_s:.2f} tok/s "
              f"(bound {bound * len(PROMPTS):.1f} tok/s for {len(PROMPTS)} rows a pass), wall {r['wall_s']:.0f} s")
        for rank, w, load in zip(r["ranks"], weights, r["load_s"] or [None] * stages):
            peak = rank["peak_rss"]
            speed = f"{w / GB / load:.2f} GB/s, {w / GB / load / disk:.2f}x the sequential read" if load else "-"
            print(f"  rank {rank['rank']}: weights {w / MB:.0f} MB, peak RSS {peak / MB:.0f} MB "
                  f"({peak / w:.2f}x), load {load or 0:.1f} s ({speed})")
        for i, m in enumerate(s.get("stage_memory_mb", [])):  # the runner's own account (pipeline.runtime.memory)
            print(f"  stage {i} memory (MiB): " + ", ".join(f"{k} {v}" for k, v in m.items() if k != "device"))
    return _write(args.json, args.model, first_read, disk, bw, results)


def _write(path: str | None, model: str, first_read: float, disk: float, bw: float, results: list) -> int:
    if path:
        Path(path).write_text(json.dumps({"model": model, "first_read_gb_s": first_read, "disk_gb_s": disk,
                                          "bandwidth_gb_s": bw, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
