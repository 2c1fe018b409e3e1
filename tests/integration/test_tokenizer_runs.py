"""sentencepiece-only tokenizer folders, and --dtype / --fp16 resolution and CPU runs: the runs that start processes (the rest: tests/unit/pipeline/loading/test_tokenizer.py)."""

from __future__ import annotations

import json
import math
import pytest
from pipeline.loading.tokenizer import load_tokenizer
from tests.utils import hf_greedy, read_jsonl, run_single
from tests.unit.pipeline.loading.test_tokenizer import _run, _sp_folder, float32_run, sp_model  # noqa: F401 (fixtures and helpers)


def test_sentencepiece_folder_end_to_end(sp_model, tmp_path):
    d = _sp_folder(tmp_path, sp_model, True, with_model=True)
    tok = load_tokenizer(d)
    req = tmp_path / "requests.jsonl"
    prompts = ["The cat sat on", "Hello world"]
    req.write_text(json.dumps({"prompt": prompts[0], "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1})
                   + "\n" + json.dumps({"prompt": prompts[1], "max_tokens": 3, "temperature": 0}) + "\n")
    r = run_single(["--model-name", str(d), "--infer-data", str(req), "--output-path", str(tmp_path / "out.jsonl")])
    assert r.returncode == 0, r.stderr
    lines = read_jsonl(tmp_path / "out.jsonl")
    assert [l["request"]["prompt"] for l in lines] == prompts
    for line, prompt in zip(lines, prompts, strict=True):
        res = line["result"]
        ids = tok(prompt)["input_ids"]
        assert ids[0] == 1 and res["usage"]["prompt_tokens"] == len(ids)
        ref, _ = hf_greedy(str(d), ids, line["request"]["max_tokens"])  # never EOS (min_new_tokens): all of them
        choice = res["choices"][0]
        assert res["usage"]["completion_tokens"] == len(ref)
        assert choice["text"].endswith(tok.decode(ref, skip_special_tokens=True))
    echo, usage = lines[0]["result"]["choices"][0]["logprobs"], lines[0]["result"]["usage"]
    assert len(echo["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"]
    assert echo["token_logprobs"][0] is None  # the BOS (whose text is empty: special tokens are skipped)
    assert "".join(echo["tokens"][: usage["prompt_tokens"]]) == prompts[0]


@pytest.mark.parametrize("flags, dtype", [(["--dtype", "bfloat16"], "bfloat16"), (["--fp16"], "float16")])
def test_half_dtypes_run_on_cpu(float32_run, tmp_path, flags, dtype):
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
