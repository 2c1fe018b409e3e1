"""Smoke tests of the benchmarks that start their systems as processes: bench/throughput.py (a tiny
model, HF + runner P=1, JSON written with every figure) and bench/native_vs_generic.py; bench/contention.py's
busy loop ends with the benchmark that started it.

No timing is asserted (the machine may be busy); only that the benchmarks run end to end, write the
expected keys and compute greedy agreement. Their pieces without a run: tests/unit/test_bench_throughput.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench.contention import BUSY_LOOP

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "throughput.py"

FIGURES = {"generated_tokens", "scored_prompt_tokens", "gen_tokens_per_s", "scored_tokens_per_s", "gen_seconds",
           "score_seconds", "wall_seconds", "startup_and_load_seconds", "peak_rss_mb", "peak_rss_mb_per_process",
           "flops_per_s", "flops_fraction_of_peak", "stage_busy", "timing", "other_load_cores"}


def test_tiny_benchmark_writes_figures_and_agreement(tmp_path):
    out = tmp_path / "t.json"
    cmd = [sys.executable, str(BENCH), "--quick", "--tiny", "--systems", "hf,runner1,hf-bf16,runner1-bf16", "--json", str(out),
           "--work-dir", str(tmp_path / "work"), "--cache-dir", str(tmp_path / "cache"), "--timeout", "120"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=str(REPO))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["profile"] == "tiny"
    assert data["workload"]["requests"] == 12
    assert data["workload"]["score_requests"] >= 1 and data["workload"]["stop_requests"] >= 1
    assert not data["failures"], data["failures"]
    assert set(data["systems"]) == {"hf", "runner1", "hf-bf16", "runner1-bf16"}
    for name, figs in data["systems"].items():
        assert FIGURES <= set(figs), (name, FIGURES - set(figs))
        assert figs["generated_tokens"] > 0 and figs["peak_rss_mb"] > 0
    assert data["matmul_peak_flops"]["1"] > 0
    agreement = data["agreement"]["runner P=1 vs HF generate"]
    assert agreement["requests"] == 12
    assert 0.0 <= agreement["fraction"] <= 1.0 and agreement["agree"] + agreement["disagree"] == 12
    assert [t["status"] in ("PASS", "FAIL", "n/a") for t in data["targets"]] == [True] * 9  # bf16 targets, no int8 ones
    bf16 = [t for t in data["targets"] if "bf16" in t["target"]]
    assert len(bf16) == 2 and bf16[1]["value"] is not None  # (a tiny run's phases may round to 0.0 s: no speed ratio)
    for pair in ("runner P=1 bf16 vs runner P=1", "HF bf16 vs HF generate"):  # fidelity against float32
        f = data["fidelity"][pair]
        assert f["positions"] > 0 and 0.5 <= f["top1_agreement"] <= 1.0 and f["mean_abs_logprob_diff"] < 0.5
    assert "--dtype bfloat16" in data["systems"]["runner1-bf16"]["command"]
    assert "runner P=1 / HF (gen tok/s)" in data["ratios"]
    assert "Targets:" in p.stdout and "Greedy agreement" in p.stdout


def test_native_vs_generic_bench_runs_and_agrees(tmp_path):
    """bench/native_vs_generic.py on a tiny Llama: both backends answer, ratios computed, outputs agree."""
    out = tmp_path / "nvg.json"
    cmd = [sys.executable, str(REPO / "bench" / "native_vs_generic.py"), "--hidden", "64", "--layers", "2",
           "--intermediate", "128", "--vocab", "1024", "--requests", "2", "--repeats", "1", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    row = json.loads(out.read_text())["rows"][0]
    assert set(row["ratios"]) == {"gen_tok_s", "score_tok_s", "peak_rss_mb"} and all(v > 0 for v in row["ratios"].values())
    assert row["agreement"]["greedy_equal"] == 2 and row["agreement"]["max_logprob_diff"] < 1e-4
    assert "generic/native" in p.stdout


def test_the_busy_loop_ends_with_the_benchmark():
    code = ("import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', {BUSY_LOOP!r}, '0'])\n"
            "print(p.pid, flush=True)\ntime.sleep(0.5)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    deadline = time.time() + 10
    while time.time() < deadline and Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
