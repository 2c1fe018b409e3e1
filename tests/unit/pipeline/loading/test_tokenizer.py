"""sentencepiece-only tokenizer folders, and --dtype / --fp16 resolution and CPU runs."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dist_inference_runner import UsageError, resolve_dtype
from pipeline.loading.tokenizer import load_tokenizer
from tests.utils import REPO, read_jsonl, run_local, tiny_llama

TEXT = "The cat sat on the mat.\nTwo  spaces, café ✓"


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    """A tiny BPE sentencepiece model trained on the local corpus (Llama's conventions: byte fallback, identity)."""
    import sentencepiece as spm

    out = tmp_path_factory.mktemp("spm")
    lines = (REPO / "examples" / "corpus.txt").read_text().splitlines()[:3000]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(out / "m"), vocab_size=400, model_type="bpe",
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, minloglevel=2, num_threads=1)
    return out / "m.model"


def _sp_folder(root: Path, sp_model: Path, add_bos: bool, with_model: bool = False) -> Path:
    d = root / f"sp-bos-{add_bos}"
    d.mkdir()
    if with_model:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
        LlamaForCausalLM(cfg).eval().save_pretrained(d)
    (d / "tokenizer.model").write_bytes(sp_model.read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": add_bos, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False}))
    assert not (d / "tokenizer.json").exists()
    return d


@pytest.mark.parametrize("add_bos", [True, False])
def test_sentencepiece_only_folder_loads_offline(sp_model, tmp_path, add_bos):
    import sentencepiece as spm

    tok = load_tokenizer(_sp_folder(tmp_path, sp_model, add_bos))
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    ids = tok(TEXT, add_special_tokens=True)["input_ids"]
    assert ids == [1] * add_bos + sp.encode(TEXT)
    assert tok(TEXT, add_special_tokens=False)["input_ids"] == sp.encode(TEXT)
    assert (tok.bos_token_id, tok.eos_token_id, len(tok)) == (1, 2, 400)
    assert tok.decode(ids, skip_special_tokens=True) == TEXT  # byte fallback, spaces and newlines survive
    assert tok.decode([1, *sp.encode("hi")]) == "<s>hi"


# ---- dtypes ----

CPU, CUDA = SimpleNamespace(type="cpu"), SimpleNamespace(type="cuda")


@pytest.mark.parametrize("cfg, device, want", [
    ({"dtype": "bfloat16"}, CPU, torch.float32),
    ({"dtype": "bfloat16"}, CUDA, torch.bfloat16),
    ({"torch_dtype": "float16"}, CUDA, torch.float16),
    ({"torch_dtype": "float32"}, CUDA, torch.float32),
    ({"text_config": {"torch_dtype": "bfloat16"}}, CUDA, torch.bfloat16),
    ({}, CUDA, torch.float16),
])
def test_auto_dtype(cfg, device, want):
    assert resolve_dtype("auto", cfg, device) is want


def test_auto_dtype_without_config_dtype_reads_the_weights(tmp_path):
    """No dtype in config.json: the dtype the safetensors weights are stored in."""
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    assert resolve_dtype("auto", {}, CUDA, str(tmp_path)) is torch.bfloat16
    assert resolve_dtype("auto", {"dtype": "float16"}, CUDA, str(tmp_path)) is torch.float16
    assert resolve_dtype("auto", {}, CPU, str(tmp_path)) is torch.float32


def test_explicit_dtype_wins():
    assert resolve_dtype("bfloat16", {"dtype": "float16"}, CPU) is torch.bfloat16
    assert resolve_dtype("float32", {"dtype": "float16"}, CUDA) is torch.float32
    with pytest.raises(UsageError, match="--dtype"):
        resolve_dtype("auto", {"dtype": "float64"}, CUDA)


def test_fp16_flag():
    from pipeline.config.options import parse_options

    assert parse_options(["--fp16"]).torch_dtype_name == "float16"
    assert parse_options(["--dtype", "bfloat16"]).torch_dtype_name == "bfloat16"
    assert parse_options([]).torch_dtype_name == "auto"
    with pytest.raises(SystemExit):
        parse_options(["--fp16", "--dtype", "bfloat16"])


@pytest.fixture(scope="module")
def float32_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtype")
    d = tiny_llama(root / "model")
    req = root / "requests.jsonl"
    req.write_text(json.dumps({"prompt": "Hello world, the cat", "max_tokens": 3, "echo": True, "logprobs": 2}) + "\n"
                   + json.dumps({"prompt": "A B C", "max_tokens": 2, "logprobs": 1, "temperature": 0}) + "\n")
    return d, req, _run(d, req, root / "out-float32.jsonl", [])


def _run(model_dir, req, out, flags):
    r = run_local(["--model-name", model_dir, "--infer-data", str(req), "--output-path", str(out), *flags])
    assert r.returncode == 0, r.stderr
    return r, read_jsonl(out)


