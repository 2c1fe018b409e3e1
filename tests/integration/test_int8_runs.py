"""--quantize int8: the int8 kernels against the fake-quantized float product, a quantized stage: the runs that start processes (the rest: tests/unit/pipeline/models/kernels/test_int8.py)."""

from __future__ import annotations

import json
from pathlib import Path
import pytest
import torch
from pipeline.models.kernels.packed import why_not
from pipeline.config.options import UsageError
from tests.utils import read_jsonl, run_inprocess, run_torchrun, write_jsonl
from tests.unit.pipeline.models.kernels.test_int8 import LOGIT_TOL, peaked  # noqa: F401 (fixtures and helpers)


def test_runs_at_p1_and_p2_agree_with_float32(peaked, tmp_path):
    """Greedy generations and echo scoring through the runner: int8 weights at P = 1 and P = 2, an
    int8 KV cache (P = 1), both (P = 2), against float32 at P = 1; two prompts share a prefix (the
    prefix pool keeps int8 records too). A float32 output is another run's for --quantize int8
    (refused, not skipped)."""
    shared = "the quick brown fox jumps over the lazy dog and runs far away into the woods, " * 2
    tok_text = ["once upon a time", "the quick brown fox", "in the beginning", "hello there, friend"]
    tok_text += [shared + "then", shared + "and so"]  # a shared prefix: the pool's blocks, copied into rows
    reqs = [{"prompt": t, "max_tokens": 8, "temperature": 0} for t in tok_text]
    reqs += [{"prompt": t, "echo": True, "max_tokens": 0, "logprobs": 1} for t in tok_text]
    data = write_jsonl(tmp_path / "req.jsonl", reqs)
    common = ["--model-name", peaked, "--infer-data", data, "--no-progress", "--num-threads", "1"]
    kv8 = ["--kv-cache-dtype", "int8"]
    runs = {"float32": ([], 1), "int8-p1": (["--quantize", "int8"], 1), "int8-p2": (["--quantize", "int8"], 2),
            "kv8-p1": (kv8, 1), "int8-kv8-p2": (["--quantize", "int8", *kv8], 2)}
    out = {}
    for name, (flags, nproc) in runs.items():
        path = tmp_path / f"{name}.jsonl"
        args = [*common, "--output-path", str(path), *flags]
        if nproc == 1:  # in this process: no interpreter start, no process group
            assert run_inprocess(args) == 0
        else:
            r = run_torchrun(args, nproc, timeout=180)
            assert r.returncode == 0, r.stderr[-3000:]
            kv = "int8 KV cache, " if "--kv-cache-dtype" in flags else ""
            assert f"int8 weights, float32 compute, {kv}kernels: stage 0 " in r.stderr and ", stage 1 " in r.stderr
        out[name] = (read_jsonl(path), json.loads(Path(f"{path}.summary.json").read_text()))
    base, base_summary = out["float32"]
    linear = "onednn" if why_not(torch.device("cpu"), torch.float32, False, "none") is None else "plain"
    assert base_summary["stage_precision"] == [{"weights": "float32", "compute_dtype": "float32", "linear": linear}]
    suffix = {"int8-p1": ":int8", "int8-p2": ":int8", "kv8-p1": ":kv-int8", "int8-kv8-p2": ":int8,kv-int8"}
    for name in suffix:
        lines, summary = out[name]
        precision = summary["stage_precision"]
        assert [s["weights"] for s in precision] == ["float32" if name == "kv8-p1" else "int8"] * runs[name][1]
        assert all(set(s.get("kernels", {}).values()) <= {"int8", "onednn", "dequantize"} for s in precision)
        assert [s.get("kv_cache") for s in precision] == ["int8" if "kv8" in name else None] * runs[name][1]
        for a, b in zip(lines, base, strict=True):
            ra, rb = a["result"], b["result"]
            assert ra["model"] == rb["model"] + suffix[name]
            ca, cb = ra["choices"][0], rb["choices"][0]
            assert ca["logprobs"]["tokens"] == cb["logprobs"]["tokens"]  # greedy tokens and echoed prompts
            assert ca["text"] == cb["text"]
            la, lb = ca["logprobs"]["token_logprobs"], cb["logprobs"]["token_logprobs"]
            assert max(abs(u - v) for u, v in zip(la, lb, strict=True) if u is not None) < LOGIT_TOL
    with pytest.raises(UsageError, match="quantize: None there, 'int8' now"):
        run_inprocess([*common, "--output-path", str(tmp_path / "float32.jsonl"), "--quantize", "int8"])
