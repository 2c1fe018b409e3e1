"""bench/gpu_check.py end to end on the CPU (``--device cpu``: the same code as on a GPU, small
models), in this process (P = 2's second stage is the one worker process), so the check a GPU lease
depends on cannot rot between GPU runs: every part passes and its JSON holds each figure."""

from __future__ import annotations

import json

from bench import gpu_check
from bench.gpu_check_models import FAMILIES
from bench.gpu_check_parts import DTYPES, PARTS


def test_gpu_check_on_the_cpu_passes_every_part(tmp_path, capsys):
    code = gpu_check.main(["--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = report["parts"]
    failed = {n: p.get("error") or p.get("failures") for n, p in parts.items() if p["status"] != "passed"}
    assert code == 0 and not failed, failed
    assert list(parts) == ["environment", *PARTS]
    assert out.strip().splitlines()[-1].startswith("gpu_check: PASS 6/6 parts")
    assert "estimate about" in out.splitlines()[0]

    env = parts["environment"]
    assert env["versions"]["torch"] and env["requirements_missing"] == [] and env["device"]["kind"] == "cpu"
    assert set(parts["parity"]["cases"]) == {f"{f}/{d}" for f in FAMILIES for d in DTYPES}
    for case in parts["parity"]["cases"].values():
        assert case["tokens"] > 0 and case["mean_error"] <= case["mean_tolerance"]

    fm = parts["file_mode"]
    assert fm["runner"]["tokens_per_s"] > 0 and fm["hf"]["tokens_per_s"] > 0 and fm["tokens_per_s_vs_hf"] > 0
    assert fm["runner"]["completion_tokens"] == fm["hf"]["generated_tokens"] or fm["runner"]["completion_tokens"] > 0
    assert fm["runner"]["time_to_first_result_s"] > 0 and fm["model"]["weights_mb"] > 0

    two = parts["two_stages"]["cases"]
    assert set(two) == {"gloo, 2 processes", "in-process, 2 threads"}
    for way in two.values():
        assert way["agreement"]["ok"] and way["agreement"]["prompts"] >= 4 and way["cached_prompt_tokens"] > 0

    quant = parts["quantized"]["cases"]
    assert set(quant) == {"int8", "fp8", "gptq-int4", "awq-int4"}
    assert {c["model"].rsplit(":", 1)[1] for c in quant.values()} == {"int8", "ct-fp8", "gptq-int4", "awq-int4"}
    assert all(c["kernels"] and c["kernels"][0] for c in quant.values())
    assert set(parts["structured"]["cases"]) == {"json", "json-sampled", "regex", "choice"}
