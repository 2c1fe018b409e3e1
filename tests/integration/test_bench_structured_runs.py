"""bench/structured.py end to end on the default model, a few requests: both files generate the same
tokens (the free twins end where the constrained rows did) and every figure is written. No timing
is asserted (the machine may be busy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_structured_bench_compares_equal_work(tmp_path):
    out = tmp_path / "figures.json"
    cmd = [sys.executable, str(REPO / "bench" / "structured.py"), "--requests", "6", "--max-tokens", "12",
           "--repeats", "1", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(REPO))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["completion_tokens"]["mixed"] == figures["completion_tokens"]["free"] > 0
    assert figures["constrained_rows"] == 3 and figures["grammars_compiled"] >= 1
    assert len(figures["mixed_runs"]) == len(figures["free_runs"]) == len(figures["pair_ratios"]) == 1
    assert figures["ratio"] > 0 and figures["compile_seconds"] >= 0 and "masks_on_thread" in figures
    assert "ratio mixed/free" in p.stdout
