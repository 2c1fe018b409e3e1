"""LoRA adapters (--lora): rows of one micro-batch with different adapters equal HF + peft with each
adapter merged, on Llama (P = 1, 2) and on families with fused projections; each stage reads only
its layers' factors; what cannot run fails before loading; the runner mixes adapters, the base and
an unknown name in one file (the prefix cache keeps adapters apart); serve mode lists adapters."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.utils import chain_greedy, chain_logits, hf_greedy, hf_logits, local_tokenizer, random_hf_model, stage_chain

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


def with_adapters(model_dir: str, ranges, adapters: list[tuple[str, str]], dtype=torch.float32,
                  cpu_linear: str = "onednn"):
    """Our stage chain for ``ranges`` with the adapters attached (as the runner's load_stage does)."""
    from pipeline.loading.adapters import check_adapter, read_adapter, stage_adapters
    from pipeline.loading.stage_weights import read_config
    from pipeline.models.families import spec_from_config

    cfg = read_config(model_dir)
    spec = spec_from_config(cfg)
    read = [read_adapter(n, p) for n, p in adapters]
    for a in read:
        check_adapter(a, cfg, spec)
    chain = stage_chain(model_dir, ranges, dtype=dtype, cpu_linear=cpu_linear)
    keys = []
    for st, (first, last) in zip(chain, ranges, strict=True):
        st.adapters, got = stage_adapters(read, cfg, spec, first, last, dtype, "cpu")
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


def test_adapters_on_the_avx2_bf16_projections(avx2_loops, llama):
    """bf16 stages without bf16 instructions (their projections the C loop): mixed adapters give what the
    plain bf16 stages give, within bf16's rounding, at P = 2."""
    from pipeline.models.kernels.packed import NativeBf16Linear

    adapters, ranges = [("a1", llama["a1"]), ("a2", llama["a2"])], [(0, 1), (1, 3)]
    fast, _ = with_adapters(llama["model"], ranges, adapters, torch.bfloat16)
    plain, _ = with_adapters(llama["model"], ranges, adapters, torch.bfloat16, cpu_linear="plain")
    assert all(isinstance(st.layers[0].mlp.up, NativeBf16Linear) for st in fast)
    ours, want = chain_logits(fast, PROMPTS, adapters=ROWS), chain_logits(plain, PROMPTS, adapters=ROWS)
    for a, b in zip(ours, want, strict=True):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)
    base = chain_logits(plain, PROMPTS, adapters=[0] * len(PROMPTS))
    assert not torch.allclose(ours[1], base[1], atol=0.1)  # the adapter row differs from its base: adapters ran


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


def test_prefix_digests_keep_adapters_apart():
    from pipeline.cache.prefix import block_digests

    ids = list(range(12))
    assert block_digests(ids, 4) != block_digests(ids, 4, b"a1")
    assert block_digests(ids, 4, b"a1") == block_digests(ids, 4, b"a1") != block_digests(ids, 4, b"a2")


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


