"""How good is ``--dry-run``'s estimate? It against the real run's time, at P = 1 and P = 2, on the
embedded default model (the shared mixed-parameters file) and on bench/throughput.py's quick model
(its mixed workload). Asserts each estimate within 30% of the real run (start-up included in both).

    python bench/estimate.py                       # 4 cases, ~15 min on 2 busy cores
    python bench/estimate.py --cases default:1 --json /tmp/e.json

The estimate is what ``--dry-run`` prints (its calibration run included in its own cost, not in the
figure); the real run is the same command without ``--dry-run``, timed from launch to exit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.throughput import PROFILES, build_model, build_workload, free_port  # noqa: E402

RUNNER = REPO / "dist_inference_runner.py"
DEFAULT_DATA = Path("/work/shared/data/mixed_params.jsonl")
BOUND = 0.30


def command(p: int, args: list[str]) -> list[str]:
    if p == 1:
        return [sys.executable, str(RUNNER), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(p), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(RUNNER), *args]


def run_case(model: str | None, data: Path, p: int, work: Path) -> dict:
    base = (["--model-name", model] if model else []) + ["--no-progress", "--overwrite", "--status-file", "none"]
    out = work / f"out-P{p}.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    dry = subprocess.run([sys.executable, str(RUNNER), *base, "--infer-data", str(data), "--output-path", str(out),
                          "--dry-run", "--pipeline-group-size", str(p)], capture_output=True, text=True, env=env)
    dry_seconds = time.monotonic() - t0
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert not out.exists(), "--dry-run wrote the output"
    m = re.search(r"^estimate: (\d+)s \((.*)\)$", dry.stdout, re.M)
    assert m, dry.stdout
    t0 = time.monotonic()
    real = subprocess.run(command(p, [*base, "--infer-data", str(data), "--output-path", str(out)]),
                          capture_output=True, text=True, env=env)
    real_seconds = time.monotonic() - t0
    assert real.returncode == 0, real.stderr[-3000:]
    estimate = float(m.group(1))
    return {"P": p, "estimate_s": estimate, "real_s": round(real_seconds, 1), "dry_run_s": round(dry_seconds, 1),
            "ratio": round(estimate / real_seconds, 3), "how": m.group(2), "plan": dry.stdout.splitlines()[:4]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="default:1,default:2,bench:1,bench:2",
                    help="comma-separated MODEL:P with MODEL default (the embedded model) or bench (quick profile)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    cache = Path(os.environ.get("DIST_INFER_CACHE", Path.home() / ".cache" / "dist-infer"))
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-estimate-") as tmp:
        work = Path(tmp)
        bench_model = bench_data = None
        for case in a.cases.split(","):
            name, p = case.split(":")
            if name == "bench" and bench_model is None:
                bench_model = build_model(cache / "bench", PROFILES["quick"])
                build_workload(bench_model, PROFILES["quick"], work / "bench")
                bench_data = work / "bench" / "workload.jsonl"
            model, data = (None, DEFAULT_DATA) if name == "default" else (str(bench_model), bench_data)
            r = {"model": name, **run_case(model, data, int(p), work / f"{name}-{p}")}
            print(f"{name} P={p}: estimate {r['estimate_s']:.0f}s, real {r['real_s']:.0f}s, ratio {r['ratio']:.2f} "
                  f"({r['how']}); the dry run itself took {r['dry_run_s']:.0f}s", flush=True)
            results.append(r)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    bad = [r for r in results if abs(r["ratio"] - 1) > BOUND]
    for r in bad:
        print(f"FAIL {r['model']} P={r['P']}: estimate off by {abs(r['ratio'] - 1):.0%} (bound {BOUND:.0%})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
