"""bench/contention.py and bench/llamacpp.py without processes: the workloads' flags and summaries, the
interleaved measurement and its ratio (runs faked), the bytes a decode step reads (the busy loop's exit
with its parent, which only processes show: tests/integration/test_bench_smoke.py)."""

from __future__ import annotations

import json
from pathlib import Path

import bench.contention as contention
import bench.llamacpp as llamacpp


def test_the_quick_start_runs_five_copies_and_reads_each_summary(tmp_path):
    args = contention.workload_args("quickstart", tmp_path)
    inputs = args[args.index("--infer-data") + 1 : args.index("--output-path")]
    assert len(inputs) == contention.QUICKSTART_COPIES and all(Path(i).read_text() for i in inputs)
    assert [p.name for p in contention.summaries(args)] == [f"output_requests{i}.jsonl.summary.json"
                                                             for i in range(contention.QUICKSTART_COPIES)]
    one = ["--infer-data", "a.jsonl", "--output-path", str(tmp_path / "o.jsonl")]
    assert contention.summaries(one) == [tmp_path / "o.jsonl.summary.json"]


def test_configurations_interleave_and_the_default_is_compared_with_the_best(tmp_path, monkeypatch):
    calls = []
    speed = {None: 1.2, 1: 1.0, 2: 1.5}

    def fake(args, threads, env, log):
        calls.append(threads)
        return speed[threads], 0.25, threads or 1

    monkeypatch.setattr(contention, "run_once", fake)
    monkeypatch.setattr(contention, "workload_args", lambda *a: ["--infer-data", "x", "--output-path", "y"])
    r = contention.measure("quiet", "quickstart", [None, 1, 2], 3, {}, tmp_path, "quick")
    assert calls == [None, 1, 2, 1, 2, None, 2, None, 1]  # rotated rounds
    assert r["best"] == "--num-threads 1" and abs(r["default_over_best"] - 1.2) < 1e-9
    assert r["default_threads"] == 1 and r["other_load_cores"] == 0.25
    assert "1.20x" in contention.report([r], "none")


def test_decode_bytes_per_token(tmp_path):
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128
    assert llamacpp.weight_bytes_per_token(tmp_path, "f32", "runner") == 4 * (2 * layer + 100 * 64)
    assert llamacpp.weight_bytes_per_token(tmp_path, "bf16", "llama.cpp") == 2 * (2 * layer + 100 * 64)
    assert llamacpp.weight_bytes_per_token(tmp_path, "int8", "runner") == 2 * layer + 4 * 100 * 64  # float32 head
    assert llamacpp.weight_bytes_per_token(tmp_path, "int8", "llama.cpp") == int((2 * layer + 100 * 64) * 34 / 32)


def test_the_llamacpp_report_prints_every_row(tmp_path):
    args = llamacpp.argparse.Namespace(threads=2, model="1b", llama_args="", repeats=1, isa="native")
    rows = [{"precision": "f32", "workload": "batch 32", "tok_s": {"runner": 36.0, "llama.cpp": 21.0}, "ratio": 1.71,
             "peak_rss_mb": {"runner": 5191, "llama.cpp": 4423}},
            {"precision": "int8", "workload": "single", "tok_s": {"runner": 22.1, "llama.cpp": 31.1}, "ratio": 0.71,
             "peak_rss_mb": {"runner": 1916, "llama.cpp": 1148}, "bandwidth_share": {"runner": 0.5, "llama.cpp": 0.6},
             "bandwidth_gb_s": 20.0}]
    text = llamacpp.report(rows, args, tmp_path)
    assert "1.71x" in text and "0.71x" in text and "0.50, 0.60 of 20.0 GB/s" in text and "held to" not in text
    args.isa = "avx2"  # --isa avx2: the report says what the engines were held to
    assert "held to AVX2" in llamacpp.report(rows, args, tmp_path).splitlines()[0]


def test_isa_avx2_holds_both_engines_to_it():
    """The runner's environment names AVX2 to PyTorch, oneDNN and MKL; llama.cpp's build turns native off."""
    assert llamacpp.ISA_ENV["avx2"]["ATEN_CPU_CAPABILITY"] == "avx2"
    assert {"ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"} <= set(llamacpp.ISA_ENV["avx2"])
    assert "-DGGML_NATIVE=OFF" in llamacpp.ISA_CMAKE["avx2"] and "-DGGML_AVX512=OFF" in llamacpp.ISA_CMAKE["avx2"]
