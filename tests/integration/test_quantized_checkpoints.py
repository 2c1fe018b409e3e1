"""Pre-quantized checkpoints through the runner: a GPTQ int4 checkpoint at P = 2 (torchrun) and a
compressed-tensors int4 one at P = 1 (with a LoRA adapter on the quantized base and the prefix
cache on shared prompts), each against the runner on the float checkpoint holding the same
dequantized weights (whose parity with transformers tests/test_llama_parity.py and
tests/unit/pipeline/loading/test_quantized.py check): greedy tokens equal, logprobs within 1e-4.
The results' ``model`` carries the format; an unsupported quantization_config exits with 2. Serve mode on a
GPTQ checkpoint: tests/runs/test_serve_models_runs.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import quant_checkpoints as qk
from tests.unit.pipeline.models.test_lora import make_adapter
from tests.utils import RUNNER, read_jsonl, run_inprocess, run_torchrun, write_jsonl

TOL = 1e-4
SHARED = "the quick brown fox jumps over the lazy dog and runs far away into the woods, " * 2


def _requests(tmp_path, model: str | None = None) -> str:
    texts = ["once upon a time", "in the beginning", SHARED + "then", SHARED + "and so"]
    reqs = [{"prompt": t, "max_tokens": 6, "temperature": 0, "logprobs": 1} for t in texts]
    reqs += [{"prompt": t, "echo": True, "max_tokens": 0, "logprobs": 1} for t in texts[:2]]
    if model:
        reqs = [r | {"model": model} for r in reqs]
    return write_jsonl(tmp_path / f"req-{model}.jsonl", reqs)


def _same(a: list[dict], b: list[dict]) -> None:
    for x, y in zip(a, b, strict=True):
        cx, cy = x["result"]["choices"][0], y["result"]["choices"][0]
        assert cx["logprobs"]["tokens"] == cy["logprobs"]["tokens"]
        la, lb = cx["logprobs"]["token_logprobs"], cy["logprobs"]["token_logprobs"]
        assert max(abs(u - v) for u, v in zip(la, lb, strict=True) if u is not None) < TOL


def _run(model: str, data: str, out: Path, nproc: int, extra: list[str] = ()) -> list[dict]:
    args = ["--model-name", model, "--infer-data", data, "--output-path", str(out), "--no-progress",
            "--num-threads", "1", *extra]
    if nproc == 1:
        assert run_inprocess(args) == 0
    else:
        r = run_torchrun(args, nproc, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    return read_jsonl(out)


def test_gptq_at_p2_matches_its_dequantized_float_checkpoint(make_llama, tmp_path):
    base = make_llama(num_hidden_layers=2, seed=5)
    q, ref = qk.gptq(base, tmp_path / "q", tmp_path / "ref", bits=4, group=32)
    data = _requests(tmp_path)
    ours = _run(q, data, tmp_path / "q.jsonl", 2)
    _same(ours, _run(ref, data, tmp_path / "ref.jsonl", 1))
    assert ours[0]["result"]["model"] == "q:gptq-int4"
    summary = json.loads(Path(f"{tmp_path / 'q.jsonl'}.summary.json").read_text())
    assert [s["weights"] for s in summary["stage_precision"]] == ["gptq-int4", "gptq-int4"]


def test_compressed_tensors_with_lora_and_prefix_cache(make_llama, tmp_path):
    base = make_llama(num_hidden_layers=2, seed=6)
    q, ref, _ = qk.compressed_tensors(base, tmp_path / "q", tmp_path / "ref", "W4A16", group_size=32)
    adapter = make_adapter(ref, tmp_path / "adapter", ["q_proj", "v_proj", "down_proj"], seed=1)
    lora = ["--lora", f"ad={adapter}"]
    for model in (None, "ad"):
        data = _requests(tmp_path, model)
        ours = _run(q, data, tmp_path / f"q-{model}.jsonl", 1, lora)
        _same(ours, _run(ref, data, tmp_path / f"ref-{model}.jsonl", 1, lora))
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
    r = subprocess.run([sys.executable, str(RUNNER), "--model-name", str(folder), "--infer-data",
                        _requests(tmp_path), "--output-path", str(tmp_path / "o.jsonl")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "GPTQ with 3 bits" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("flag", [["--quantize", "int8"], ["--batch-invariant"]])
def test_refused_combinations(make_llama, tmp_path, flag):
    from pipeline.config.options import UsageError

    base = make_llama(num_hidden_layers=2, seed=5)
    q, _ = qk.gptq(base, tmp_path / "q", tmp_path / "ref", bits=4, group=32)
    with pytest.raises(UsageError, match="gptq-int4"):
        run_inprocess(["--model-name", q, "--infer-data", _requests(tmp_path), "--output-path",
                       str(tmp_path / "o.jsonl"), *flag])
