"""Precision through the runner, in one process (``--in-process`` at P = 2): bfloat16 and float16 stages
on the CPU follow float32; int8 weights and an int8 KV cache at P = 1 and 2 agree with float32;
pre-quantized checkpoints (GPTQ int4 at P = 2, compressed-tensors int4 with a LoRA adapter and the
prefix cache) against the runner on the float checkpoint holding the same dequantized weights (whose
parity with transformers tests/unit/pipeline/loading/test_quantized.py checks); the results' ``model``
names the format; refusals exit 2 before loading."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pipeline.config.options import UsageError
from pipeline.models.kernels.packed import why_not
from pipeline.models.kernels.int8 import KERNELS
from tests import quant_checkpoints as qk
from tests.unit.pipeline.loading.test_tokenizer import float32_run  # noqa: F401 (a fixture)
from tests.unit.pipeline.models.kernels.test_int8 import LOGIT_TOL, peaked  # noqa: F401 (a fixture)
from tests.unit.pipeline.models.test_lora import make_adapter
from tests.utils import read_jsonl, run_inprocess, run_local, write_jsonl

TOL = 1e-4
SHARED = "the quick brown fox jumps over the lazy dog and runs far away into the woods, " * 2


@pytest.mark.parametrize("flags, dtype", [(["--dtype", "bfloat16"], "bfloat16"), (["--fp16"], "float16")])
def test_half_dtypes_run_on_cpu(float32_run, tmp_path, flags, dtype):  # noqa: F811 (the fixture)
    from tests.unit.pipeline.loading.test_tokenizer import _run

    d, req, (r32, ref) = float32_run
    assert "dtype torch.float32" in r32.stderr  # auto on CPU
    r, lines = _run(d, req, tmp_path / "out.jsonl", flags)
    assert f"dtype torch.{dtype}" in r.stderr
    for line, ref_line in zip(lines, ref, strict=True):
        lp = line["result"]["choices"][0]["logprobs"]
        values = [v for v in lp["token_logprobs"] if v is not None]
        assert values and all(isinstance(v, float) and math.isfinite(v) and v <= 0 for v in values)
    # the echoed prompt's logprobs follow the float32 ones (random tiny model: within half-precision error)
    ours = lines[0]["result"]["choices"][0]["logprobs"]["token_logprobs"]
    theirs = ref[0]["result"]["choices"][0]["logprobs"]["token_logprobs"]
    n = len(lines[0]["result"]["choices"][0]["logprobs"]["tokens"]) - 3
    assert max(abs(a - b) for a, b in zip(ours[1:n], theirs[1:n], strict=True)) < 0.05


def test_int8_runs_at_p1_and_p2_agree_with_float32(peaked, tmp_path):  # noqa: F811 (the fixture)
    """Greedy generations and echo scoring through the runner: int8 weights at P = 1 and P = 2, an
    int8 KV cache (P = 1), both (P = 2), against float32 at P = 1; two prompts share a prefix (the
    prefix pool keeps int8 records too). A float32 output is another run's for --quantize int8
    (refused, not skipped)."""
    tok_text = ["once upon a time", "the quick brown fox", "in the beginning", "hello there, friend"]
    tok_text += [SHARED + "then", SHARED + "and so"]  # a shared prefix: the pool's blocks, copied into rows
    reqs = [{"prompt": t, "max_tokens": 8, "temperature": 0} for t in tok_text]
    reqs += [{"prompt": t, "echo": True, "max_tokens": 0, "logprobs": 1} for t in tok_text]
    data = write_jsonl(tmp_path / "req.jsonl", reqs)
    common = ["--model-name", peaked, "--infer-data", data, "--no-progress", "--num-threads", "1"]
    kv8 = ["--kv-cache-dtype", "int8"]
    runs = {"float32": ([], 1), "int8-p1": (["--quantize", "int8"], 1), "int8-p2": (["--quantize", "int8"], 2),
            "kv8-p1": (kv8, 1), "int8-kv8-p2": (["--quantize", "int8", *kv8], 2)}
    out = {}
    for name, (flags, stages) in runs.items():
        path = tmp_path / f"{name}.jsonl"
        r = run_local([*common, "--output-path", str(path), *flags], stages)
        assert r.returncode == 0, r.stderr[-3000:]
        if stages > 1:
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
        assert all(set(s.get("kernels", {}).values()) <= set(KERNELS) for s in precision)
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


# -- pre-quantized checkpoints -------------------------------------------------------------------

def quant_requests(tmp_path, model: str | None = None) -> str:
    texts = ["once upon a time", "in the beginning", SHARED + "then", SHARED + "and so"]
    reqs = [{"prompt": t, "max_tokens": 6, "temperature": 0, "logprobs": 1} for t in texts]
    reqs += [{"prompt": t, "echo": True, "max_tokens": 0, "logprobs": 1} for t in texts[:2]]
    if model:
        reqs = [r | {"model": model} for r in reqs]
    return write_jsonl(tmp_path / f"req-{model}.jsonl", reqs)


def assert_same_tokens(a: list[dict], b: list[dict]) -> None:
    """The same tokens, logprobs within TOL."""
    for x, y in zip(a, b, strict=True):
        cx, cy = x["result"]["choices"][0], y["result"]["choices"][0]
        assert cx["logprobs"]["tokens"] == cy["logprobs"]["tokens"]
        la, lb = cx["logprobs"]["token_logprobs"], cy["logprobs"]["token_logprobs"]
        assert max(abs(u - v) for u, v in zip(la, lb, strict=True) if u is not None) < TOL


def run_file(model: str, data: str, out: Path, stages: int = 1, extra: list[str] = ()) -> list[dict]:
    r = run_local(["--model-name", model, "--infer-data", data, "--output-path", str(out), "--no-progress",
                   "--num-threads", "1", *extra], stages)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_jsonl(out)


def test_gptq_at_p2_matches_its_dequantized_float_checkpoint(make_llama, tmp_path):
    base = make_llama(num_hidden_layers=2, seed=5)
    q, ref = qk.gptq(base, tmp_path / "q", tmp_path / "ref", bits=4, group=32)
    data = quant_requests(tmp_path)
    ours = run_file(q, data, tmp_path / "q.jsonl", 2)
    assert_same_tokens(ours, run_file(ref, data, tmp_path / "ref.jsonl"))
    assert ours[0]["result"]["model"] == "q:gptq-int4"
    summary = json.loads(Path(f"{tmp_path / 'q.jsonl'}.summary.json").read_text())
    assert [s["weights"] for s in summary["stage_precision"]] == ["gptq-int4", "gptq-int4"]
    for flag, why in ((["--quantize", "int8"], "quantized already"), (["--batch-invariant"], "packed weights")):
        with pytest.raises(UsageError, match=why):  # refused with a GPTQ checkpoint, before loading
            run_inprocess(["--model-name", q, "--infer-data", data, "--output-path", str(tmp_path / "o.jsonl"), *flag])


def test_compressed_tensors_with_lora_and_prefix_cache(make_llama, tmp_path):
    base = make_llama(num_hidden_layers=2, seed=6)
    q, ref, _ = qk.compressed_tensors(base, tmp_path / "q", tmp_path / "ref", "W4A16", group_size=32)
    adapter = make_adapter(ref, tmp_path / "adapter", ["q_proj", "v_proj", "down_proj"], seed=1)
    lora = ["--lora", f"ad={adapter}"]
    for model in (None, "ad"):
        data = quant_requests(tmp_path, model)
        ours = run_file(q, data, tmp_path / f"q-{model}.jsonl", 1, lora)
        assert_same_tokens(ours, run_file(ref, data, tmp_path / f"ref-{model}.jsonl", 1, lora))
        assert ours[0]["result"]["model"] == ("ad" if model else "q:ct-int4")


def test_unsupported_quantization_config_exits_2(make_llama, tmp_path):
    base = Path(make_llama(num_hidden_layers=2, seed=5))
    folder = tmp_path / "bnb"
    folder.mkdir()
    for f in base.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((base / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 3, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(cfg))
    r = run_local(["--model-name", str(folder), "--infer-data", quant_requests(tmp_path), "--output-path",
                   str(tmp_path / "o.jsonl")])
    assert r.returncode == 2, r.stderr[-2000:]
    assert "GPTQ with 3 bits" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o.jsonl").exists()
