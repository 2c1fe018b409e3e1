"""The generic transformers stage (--backend): HF parity for families without native code (StarCoder2: the runs that start processes (the rest: tests/unit/pipeline/models/test_hf_stage.py)."""

from __future__ import annotations

from tests.utils import assert_consistent_results, read_jsonl, run_inprocess, run_single, run_torchrun, write_jsonl
from tests.unit.pipeline.models.test_hf_stage import _check_against_hf, _requests, llama, models  # noqa: F401 (fixtures and helpers)


def test_native_backend_for_unknown_family_fails_fast(models, tmp_path):
    proc = run_single(["--model-name", models("starcoder2"), "--backend", "native", "--infer-data",
                       write_jsonl(tmp_path / "r.jsonl", [{"prompt": "hi", "max_tokens": 1}])], timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--backend auto" in proc.stderr and "llama" in proc.stderr and "starcoder2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_p2_generic_family_echo_and_greedy_match_hf(models, tmp_path):
    d = models("starcoder2")
    src, out = write_jsonl(tmp_path / "r.jsonl", _requests()), tmp_path / "out.jsonl"
    proc = run_torchrun(["--model-name", d, "--infer-data", src, "--output-path", str(out), "--no-progress"], 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_against_hf(d, read_jsonl(out))


def test_cli_p2_llama_transformers_backend_equals_native(llama, tmp_path):
    src = write_jsonl(tmp_path / "r.jsonl", _requests())
    native, generic = tmp_path / "native.jsonl", tmp_path / "generic.jsonl"
    assert run_inprocess(["--model-name", llama, "--infer-data", src, "--output-path", str(native),
                          "--no-progress", "--prefix-cache", "off"]) == 0  # the generic stage has none
    proc = run_torchrun(["--model-name", llama, "--infer-data", src, "--output-path", str(generic), "--no-progress",
                         "--backend", "transformers"], 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_consistent_results(read_jsonl(native), read_jsonl(generic))
    _check_against_hf(llama, read_jsonl(generic))
