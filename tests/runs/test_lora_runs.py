"""LoRA adapters (--lora) through the runner, in one process (``--in-process``): rows of base and adapter
requests mixed at P = 2 with unequal stages and the prefix cache equal HF + peft with each adapter
merged; unsupported adapters refused before loading. The stage math against peft:
tests/unit/pipeline/models/test_lora.py."""

from __future__ import annotations

import pytest

from tests.unit.pipeline.models.test_lora import _edit_config, llama, make_adapter  # noqa: F401 (a fixture)
from tests.utils import hf_greedy, local_tokenizer, read_jsonl, run_local, write_jsonl


def test_unsupported_adapters_fail_before_loading(llama, make_llama, tmp_path):  # noqa: F811 (the fixture)
    from pipeline.loading.adapters import AdapterError, check_adapter, read_adapter
    from pipeline.loading.stage_weights import read_config
    from pipeline.models.families import spec_from_config

    model = llama["model"]
    cfg = read_config(model)
    spec = spec_from_config(cfg)
    cases = [
        (_edit_config(llama["a1"], tmp_path / "dora", use_dora=True), "DoRA"),
        (_edit_config(llama["a1"], tmp_path / "save", modules_to_save=["lm_head"]), "modules_to_save"),
        (_edit_config(llama["a1"], tmp_path / "alpha", alpha_pattern={"q_proj": 4}), "alpha_pattern"),
        (make_adapter(model, tmp_path / "head", ["lm_head"], seed=5), "lm_head"),
        (make_adapter(model, tmp_path / "emb", ["embed_tokens"], seed=5), "not a LoRA A/B factor"),
        (make_adapter(make_llama(num_hidden_layers=3, hidden_size=32, intermediate_size=64), tmp_path / "other",
                      ["q_proj"], seed=5), "trained on another model"),
        (str(tmp_path), "no adapter_config.json"),
    ]
    for path, message in cases:
        with pytest.raises(AdapterError, match=message):
            check_adapter(read_adapter("x", path), cfg, spec)
    # through the runner's command line: exit 2 with the message, before any weights
    res = run_local(["--model-name", model, "--lora", f"a1={llama['a1']}", "--backend", "transformers"])
    assert res.returncode == 2 and "--lora needs a native family" in res.stderr
    res = run_local(["--model-name", model, "--lora", f"bad={cases[0][0]}", "--no-progress"])
    assert res.returncode == 2 and "DoRA" in res.stderr
    res = run_local(["--model-name", model, "--lora", f"a1={llama['a1']}", "--batch-invariant"])
    assert res.returncode == 2 and "--batch-invariant does not apply LoRA adapters" in res.stderr
    for flags in (["--lora", f"{model.rstrip('/').rsplit('/', 1)[-1]}={llama['a1']}"],
                  ["--lora", f"tiny={llama['a1']}", "--served-model-name", "tiny"]):
        res = run_local(["--model-name", model, *flags])  # its requests would get the base model
        assert res.returncode == 2 and "is the base model's name" in res.stderr
    res = run_local(["--model-name", model, "--lora", "a1"])
    assert res.returncode == 2 and "expected NAME=PATH" in res.stderr


def test_runner_mixes_adapters_base_and_an_unknown_name(llama, tmp_path):  # noqa: F811 (the fixture)
    """P = 2 with unequal stages (1 + 2 layers) and the prefix cache on small blocks: a base and an
    adapter request with the same prompt must not share cached keys and values; two a1 requests do."""
    shared = "The quick brown fox jumps over the lazy dog and runs"
    reqs = [{"prompt": shared, "max_tokens": 5, "temperature": 0, "logprobs": 1},
            {"prompt": shared, "max_tokens": 5, "temperature": 0, "logprobs": 1, "model": "a1"},
            {"prompt": shared + " away", "max_tokens": 5, "temperature": 0, "logprobs": 1, "model": "a1"},
            {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "logprobs": 1, "model": "nope"},
            {"prompt": shared, "max_tokens": 5, "temperature": 0, "logprobs": 1, "model": "a2"},
            {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "logprobs": 1, "model": "org/llama"}]
    src = write_jsonl(tmp_path / "r.jsonl", reqs)
    model_link = tmp_path / "llama"
    model_link.symlink_to(llama["model"])  # the base model's folder name: "llama"
    res = run_local(["--model-name", str(model_link), "--infer-data", src, "--lora", f"a1={llama['a1']}",
                     "--lora", f"a2={llama['a2']}", "--layers-per-stage", "1,2", "--prefix-block-size", "4",
                     "--no-progress"], 2)
    assert res.returncode == 0, res.stderr[-3000:]
    out = read_jsonl(tmp_path / "output_r.jsonl")
    assert "unknown model 'nope'" in out[3]["error"]["message"] and out[3]["error"]["param"] == "model"
    assert [o["result"]["model"] for i, o in enumerate(out) if i != 3] == ["llama", "a1", "a1", "a2", "llama"]
    tok = local_tokenizer()
    for i, k in [(0, 0), (1, 1), (2, 1), (4, 2), (5, 0)]:
        ids = tok(reqs[i]["prompt"])["input_ids"]
        ref_t, ref_lp = hf_greedy(llama["ref"][k], ids, 5)
        choice = out[i]["result"]["choices"][0]
        assert choice["text"] == tok.decode(ref_t, skip_special_tokens=True), i
        assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], ref_lp, strict=True)) < 1e-4
    assert out[2]["result"]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # a1 reused a1's blocks


def test_the_default_models_folder_name_selects_the_base(tmp_path):
    """lora.md: the model folder's name selects the base, also for the embedded default model, whose results
    carry its versioned name (tiny-llama-default-v5), not its folder's."""
    from pipeline.loading.default_model import default_model_dir

    adapter = make_adapter(str(default_model_dir()), tmp_path / "a", ["q_proj"], seed=3)
    reqs = [{"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0, "model": m}
            for m in ("tiny-llama-default", "org/tiny-llama-default", "a")]
    src = write_jsonl(tmp_path / "r.jsonl", reqs)
    res = run_local(["--infer-data", src, "--lora", f"a={adapter}", "--no-progress"])
    assert res.returncode == 0, res.stderr[-3000:]
    out = read_jsonl(tmp_path / "output_r.jsonl")
    assert [o.get("error") for o in out] == [None] * 3, out
    assert out[0]["result"]["model"] == out[1]["result"]["model"] != "a" and out[2]["result"]["model"] == "a"
