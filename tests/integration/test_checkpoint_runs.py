"""Checkpoint formats load lazily and identically; broken checkpoints fail naming the file and tensor: the runs that start processes (the rest: tests/unit/pipeline/loading/test_checkpoints.py)."""

from __future__ import annotations

import json
from tests.utils import run_single
from tests.unit.pipeline.loading.test_checkpoints import _broken, formats  # noqa: F401 (fixtures and helpers)


def test_runner_reports_broken_checkpoint(formats, tmp_path):
    d = _broken(formats, tmp_path, "safetensors-sharded")
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.layers.0.self_attn.q_proj.weight"]
    (d / shard).unlink()
    req = tmp_path / "req.jsonl"
    req.write_text(json.dumps({"prompt": "hello", "max_tokens": 2}) + "\n")
    r = run_single(["--model-name", str(d), "--infer-data", str(req)], timeout=120)
    assert r.returncode != 0
    assert str(d / shard) in r.stderr
    assert any(f"tensor {n!r}" in r.stderr for n, f in index.items() if f == shard), r.stderr
    assert "Traceback" not in r.stderr
