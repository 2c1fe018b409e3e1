"""A job preempted again and again: every line answered once, the outputs an uninterrupted run's, and the
time it costs.

    python bench/preempt.py                             # 500 lines x 256 tokens, SIGTERM every ~20 s, then SIGKILL
    python bench/preempt.py --lines 100 --max-tokens 128 --every 5 --signals TERM --stages 2

Writes a request file of long generations (greedy and seeded, half each), runs it once uninterrupted
(the reference), then for each signal runs the same command again and again, sending the signal every
``--every`` seconds (+-20%, from a fixed seed) until a run completes. It prints each run's count, that
every line is answered exactly once, how many lines equal the reference (tokens; tokens and logprobs),
and the total wall time against the reference's, with the loading time each restart paid (the
reference's start-up) taken apart: the target for SIGTERM is at most 1.3x the reference plus the
restarts' loading. SIGKILL runs checkpoint every ``--checkpoint-interval`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "dist_inference_runner.py"


def requests(n: int, max_tokens: int) -> list[dict]:
    stories = ["Once upon a time", "There was a kind little frog", "Tom has 3 apples and Ann has",
               "The garden is west of the kitchen."]
    return [{"prompt": f"{stories[i % len(stories)]} ({i})", "max_tokens": max_tokens, "logprobs": 1,
             **({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": i})} for i in range(n)]


def command(src: Path, out: Path, args) -> list[str]:
    base = [str(RUNNER), "--infer-data", str(src), "--output-path", str(out), "--no-progress",
            "--checkpoint-interval", str(args.checkpoint_interval), *args.flags]
    if args.stages > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.stages),
                "--master-addr", "127.0.0.1", "--master-port", str(29400 + random.randrange(500)), *base]
    return [sys.executable, *base]


def run(cmd: list[str], every: float | None, sig: int, rng: random.Random) -> tuple[int, float]:
    """One run; with ``every`` the signal after about that many seconds. (exit code, seconds)."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        code = p.wait(timeout=every * rng.uniform(0.8, 1.2)) if every else p.wait()
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, sig)
        code = p.wait()
    return code, time.monotonic() - t0


def compare(ref: list[dict], got: list[dict]) -> tuple[int, int]:
    """(lines with the reference's tokens, lines with its tokens and logprobs)."""
    tokens = exact = 0
    for a, b in zip(ref, got, strict=True):
        ca, cb = a["result"]["choices"][0], b["result"]["choices"][0]
        tokens += ca["logprobs"]["tokens"] == cb["logprobs"]["tokens"]
        exact += ca["logprobs"] == cb["logprobs"]
    return tokens, exact


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--every", type=float, default=20.0, help="seconds between signals (+-20%%)")
    ap.add_argument("--signals", nargs="+", default=["TERM", "KILL"], choices=["TERM", "KILL", "INT"])
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--checkpoint-interval", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("flags", nargs="*", help="more runner flags (after --), e.g. -- --batch-invariant")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    figures = {}
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "long.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in requests(args.lines, args.max_tokens)))
        ref_out = Path(d) / "reference.jsonl"
        code, ref_s = run(command(src, ref_out, args), None, signal.SIGTERM, rng)
        assert code == 0, "the reference run failed"
        ref = [json.loads(x) for x in ref_out.read_text().splitlines()]
        summary = json.loads(Path(str(ref_out) + ".summary.json").read_text())
        load_s = summary.get("startup_seconds") or 0.0
        print(f"reference: {len(ref)} lines, {summary['completion_tokens']} tokens in {ref_s:.1f}s "
              f"(of it start-up {load_s:.1f}s)")
        for name in args.signals:
            sig = getattr(signal, f"SIG{name}")
            out = Path(d) / f"cut-{name}.jsonl"
            runs, total = 0, 0.0
            journal = Path(str(out) + ".partial")
            while not out.exists():
                code, s = run(command(src, out, args), args.every, sig, rng)
                runs, total = runs + 1, total + s
                done = journal.read_bytes().count(b"\n") if journal.exists() else len(ref)
                print(f"  SIG{name} run {runs}: exit {code} after {s:.1f}s, {done}/{len(ref)} lines journaled", flush=True)
                if runs > 200:
                    raise SystemExit(f"SIG{name}: no end after {runs} runs")
            got = [json.loads(x) for x in out.read_text().splitlines()]
            once = len(got) == len(ref) and all("result" in g for g in got)
            tokens, exact = compare(ref, got)
            budget = 1.3 * ref_s + (runs - 1) * load_s
            figures[name] = {"runs": runs, "seconds": round(total, 1), "reference_seconds": round(ref_s, 1),
                             "ratio": round(total / ref_s, 3), "target_seconds": round(budget, 1),
                             "answered_once": once, "same_tokens": tokens, "same_logprobs": exact, "lines": len(ref)}
            print(f"SIG{name}: {runs} runs, {total:.1f}s = {total / ref_s:.2f}x the reference (target for "
                  f"SIGTERM: {budget:.1f}s = 1.3x + {runs - 1} restarts' start-up); every line answered once: {once}; "
                  f"same tokens {tokens}/{len(ref)}, same tokens and logprobs {exact}/{len(ref)}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
