"""LoRA adapters (--lora): rows of one micro-batch with different adapters equal HF + peft with each
adapter merged, on Llama (P = 1, 2) and on families with fused projections; each stage reads only
its layers' factors; what cannot run fails before loading; the runner mixes adapters, the base and
an unknown name in one file (the prefix cache keeps adapters apart); serve mode lists adapters."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import peft  # a declared test dependency (requirements-test.txt): missing, the tests fail
import pytest
import torch

from tests.utils import (
    RUNNER,
    _env,
    chain_greedy,
    chain_logits,
    free_port,
    hf_greedy,
    hf_logits,
    local_tokenizer,
    random_hf_model,
    read_jsonl,
    run_single,
    run_torchrun,
    stage_chain,
    write_jsonl,
)

PROMPTS = [[5, 9, 13, 2, 7, 21], [3, 4, 8], [11, 12, 13, 14, 15, 16, 17], [6, 6, 40, 41]]
ROWS = [0, 1, 2, 1]  # the adapter of each prompt's row: base, a1, a2, a1
ALL_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: str, out, targets, seed: int, r: int = 4, alpha: int = 8, **kw) -> str:
    """A PEFT adapter of random factors (peft initialises lora_B to zero: that would test nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, **kw))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(str(out))
    return str(out)


def merged(model_dir: str, adapter: str, out) -> str:
    """HF model with the adapter merged by peft, saved as a model folder (the reference)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter).merge_and_unload()
    model.save_pretrained(str(out))
    local_tokenizer().save_pretrained(str(out))
    return str(out)


def with_adapters(model_dir: str, ranges, adapters: list[tuple[str, str]]):
    """Our stage chain for ``ranges`` with the adapters attached (as the runner's load_stage does)."""
    from pipeline.loading.adapters import check_adapter, read_adapter, stage_adapters
    from pipeline.loading.stage_weights import read_config
    from pipeline.models.families import spec_from_config

    cfg = read_config(model_dir)
    spec = spec_from_config(cfg)
    read = [read_adapter(n, p) for n, p in adapters]
    for a in read:
        check_adapter(a, cfg, spec)
    chain = stage_chain(model_dir, ranges)
    keys = []
    for st, (first, last) in zip(chain, ranges, strict=True):
        st.adapters, got = stage_adapters(read, cfg, spec, first, last, torch.float32, "cpu")
        keys.append(got)
    return chain, keys


@pytest.fixture(scope="module")
def llama(make_llama, tmp_path_factory):
    """3-layer GQA Llama, adapter a1 (q, v, o: part of the fused qkv) and a2 (every projection, rsLoRA),
    and the merged references."""
    model = make_llama(num_hidden_layers=3, num_key_value_heads=2)
    d = tmp_path_factory.mktemp("lora")
    a1 = make_adapter(model, d / "a1", ["q_proj", "v_proj", "o_proj"], seed=1)
    a2 = make_adapter(model, d / "a2", ALL_LLAMA, seed=2, r=8, alpha=16, use_rslora=True)
    return {"model": model, "a1": a1, "a2": a2, "dir": d,
            "ref": [model, merged(model, a1, d / "m1"), merged(model, a2, d / "m2")]}


@pytest.mark.parametrize("ranges", [[(0, 3)], [(0, 1), (1, 3)]], ids=["P1", "P2"])
def test_mixed_adapters_in_one_micro_batch_match_peft(llama, ranges):
    chain, keys = with_adapters(llama["model"], ranges, [("a1", llama["a1"]), ("a2", llama["a2"])])
    for prompt, k, ours in zip(PROMPTS, ROWS, chain_logits(chain, PROMPTS, adapters=ROWS), strict=True):
        torch.testing.assert_close(ours, hf_logits(llama["ref"][k], prompt), atol=1e-4, rtol=1e-4)
    toks, lps = chain_greedy(chain, PROMPTS, 5, adapters=ROWS)
    for prompt, k, t, lp in zip(PROMPTS, ROWS, toks, lps, strict=True):
        ref_t, ref_lp = hf_greedy(llama["ref"][k], prompt, 5)
        assert t == ref_t
        assert max(abs(a - b) for a, b in zip(lp, ref_lp, strict=True)) < 1e-4
    if len(ranges) == 2:  # each stage read only its own layers' factors
        assert keys[0] and all(".layers.0." in k for k in keys[0])
        assert keys[1] and all(".layers.1." in k or ".layers.2." in k for k in keys[1])


@pytest.mark.parametrize("family, overrides, targets", [
    ("phi3", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2),
     ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    ("falcon", dict(hidden_size=32, num_attention_heads=4, new_decoder_architecture=True, num_kv_heads=2),
     ["query_key_value", "dense", "dense_h_to_4h"]),
    ("gpt2", dict(n_embd=32, n_head=4), ["c_attn", "c_proj", "c_fc"]),  # Conv1D: fan_in_fan_out
])
def test_adapters_on_fused_projections(tmp_path, family, overrides, targets):
    model = random_hf_model(tmp_path / "m", family, **overrides)
    a = make_adapter(model, tmp_path / "a", targets, seed=3, **({"fan_in_fan_out": True} if family == "gpt2" else {}))
    b = make_adapter(model, tmp_path / "b", targets[:1], seed=4, r=2)
    refs = [model, merged(model, a, tmp_path / "ma"), merged(model, b, tmp_path / "mb")]
    chain, _ = with_adapters(model, [(0, 1), (1, 3)], [("a", a), ("b", b)])
    rows = [1, 0, 2]
    for prompt, k, ours in zip(PROMPTS[:3], rows, chain_logits(chain, PROMPTS[:3], adapters=rows), strict=True):
        torch.testing.assert_close(ours, hf_logits(refs[k], prompt), atol=1e-4, rtol=1e-4)


def _edit_config(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_unsupported_adapters_fail_before_loading(llama, make_llama, tmp_path):
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
    from pipeline.config.options import UsageError, parse_options
    from pipeline.config.plan import make_plan

    with pytest.raises(UsageError, match="--lora needs a native family"):
        make_plan(parse_options(["--model-name", model, "--lora", f"a1={llama['a1']}", "--backend", "transformers"]),
                  env={"RANK": "0", "WORLD_SIZE": "1"})
    # through the runner: exit 2 with the message, before any process group or weights
    res = run_single(["--model-name", model, "--lora", f"bad={cases[0][0]}", "--no-progress"], timeout=120)
    assert res.returncode == 2 and "DoRA" in res.stderr
    res = run_single(["--model-name", model, "--lora", f"a1={llama['a1']}", "--batch-invariant"], timeout=120)
    assert res.returncode == 2 and "--batch-invariant does not apply LoRA adapters" in res.stderr
    res = run_single(["--model-name", model, "--lora", "a1"], timeout=120)
    assert res.returncode == 2 and "expected NAME=PATH" in res.stderr


def test_prefix_digests_keep_adapters_apart():
    from pipeline.cache.prefix import block_digests

    ids = list(range(12))
    assert block_digests(ids, 4) != block_digests(ids, 4, b"a1")
    assert block_digests(ids, 4, b"a1") == block_digests(ids, 4, b"a1") != block_digests(ids, 4, b"a2")


def test_runner_mixes_adapters_base_and_an_unknown_name(llama, tmp_path):
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
    res = run_torchrun(["--model-name", str(model_link), "--infer-data", src, "--lora", f"a1={llama['a1']}",
                        "--lora", f"a2={llama['a2']}", "--layers-per-stage", "1,2", "--prefix-block-size", "4",
                        "--no-progress"], nproc=2, timeout=300)
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


def _http(url: str, body: dict | None = None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve_lists_and_runs_adapters(llama, tmp_path):
    port = free_port()
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, str(RUNNER), "--model-name", llama["model"], "--serve", str(port),
                             "--served-model-name", "base", "--lora", f"a1={llama['a1']}", "--num-threads", "1",
                             "--serve-dir", str(tmp_path / "s")], stdout=log, stderr=log, env=_env(None),
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if _http(url + "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.3)
        assert [m["id"] for m in _http(url + "/v1/models")[1]["data"]] == ["base", "a1"]
        prompt = [5, 9, 13, 2, 7, 21]
        body = {"model": "a1", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1}
        status, r = _http(url + "/v1/completions", body)
        assert status == 200 and r["model"] == "a1"
        tok = local_tokenizer()
        ref_t, ref_lp = hf_greedy(llama["ref"][1], prompt, 4)
        assert max(abs(a - b) for a, b in zip(r["choices"][0]["logprobs"]["token_logprobs"], ref_lp, strict=True)) < 1e-4
        assert r["choices"][0]["text"] == tok.decode(ref_t, skip_special_tokens=True)
        status, r = _http(url + "/v1/completions", dict(body, model="a9"))
        assert status == 404 and "'base', 'a1'" in r["error"]["message"]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
