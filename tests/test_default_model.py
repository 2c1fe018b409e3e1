"""The embedded default model: deterministic build, offline tokenizer, safe concurrent caching."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from examples import default_model as dm

HASHED_FILES = ["tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"]
TEXTS = [
    "Hello, world! The café on Elm Street is naïve about 日本 and 東京 🙂.",
    "  leading spaces, trailing spaces  \n\ttabs and\r\nnewlines\n",
    "Numbers 0 12 345 6789, prices $3.50 and 100%; symbols <>&#@{}[]|\\~`^",
    "Unseen scripts: Ωμέγα, русский, हिन्दी, عربى, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, ZWJ 👩‍👩‍👧",
    "",
]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _hashes(folder: str | Path) -> dict[str, str]:
    return {name: _sha256(Path(folder) / name) for name in HASHED_FILES}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def model_dir(cache: Path) -> str:
    """Built once through the public entry point, with the cache pointed at a tmp dir."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DIST_INFER_CACHE", str(cache))
        return dm.default_model_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def test_cache_path_logic(model_dir: str, cache: Path, monkeypatch, tmp_path: Path) -> None:
    assert Path(model_dir) == cache / dm.DEFAULT_MODEL_NAME == cache / "tiny-llama-default-v1"
    assert dm.is_complete(model_dir)
    monkeypatch.delenv("DIST_INFER_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dm.cache_root() == tmp_path / ".cache" / "dist-inference-runner"
    # Only the final folder remains: no temporary siblings left behind.
    assert [p.name for p in cache.iterdir()] == [dm.DEFAULT_MODEL_NAME]


def test_config_is_llama_with_gqa(model_dir: str, tokenizer) -> None:
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (256, 688, 4)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 4)
    assert config.max_position_embeddings == 2048
    assert config.tie_word_embeddings is False
    assert config.vocab_size == len(tokenizer) == dm.VOCAB_SIZE
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 1, 2)
    raw = (Path(model_dir) / "config.json").read_text()
    assert '"dtype": "float32"' in raw or '"torch_dtype": "float32"' in raw


def test_special_tokens_and_bos(tokenizer) -> None:
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    ids = tokenizer("The harbor is quiet.")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in ids[1:]
    assert tokenizer("x", add_special_tokens=False)["input_ids"][0] != tokenizer.bos_token_id
    assert tokenizer.padding_side == "left"


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_exactly(tokenizer, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids[1:]) == text


def test_chat_template(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, café?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s>system: Be brief.\nuser: Hi, café?\nassistant:"
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = out["input_ids"] if not isinstance(out, list) else out
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_build_is_deterministic(model_dir: str, tmp_path: Path) -> None:
    dm.build_default_model(str(tmp_path / "again"))
    assert _hashes(tmp_path / "again") == _hashes(model_dir)


def test_default_model_dir_is_idempotent(model_dir: str, cache: Path, monkeypatch) -> None:
    monkeypatch.setenv("DIST_INFER_CACHE", str(cache))
    marker = Path(model_dir) / dm.COMPLETE_MARKER
    before = marker.stat().st_mtime_ns
    assert dm.default_model_dir() == model_dir
    assert marker.stat().st_mtime_ns == before  # not rebuilt


def _build_in_child(cache: str) -> tuple[str, dict[str, str]]:
    os.environ["DIST_INFER_CACHE"] = cache
    torch.set_num_threads(1)
    folder = dm.default_model_dir()
    return folder, _hashes(folder)


def test_concurrent_processes_share_one_folder(model_dir: str, tmp_path: Path) -> None:
    cache = tmp_path / "shared-cache"
    with mp.get_context("spawn").Pool(2) as pool:
        results = pool.map(_build_in_child, [str(cache)] * 2)
    (dir_a, hashes_a), (dir_b, hashes_b) = results
    assert dir_a == dir_b == str(cache / dm.DEFAULT_MODEL_NAME)
    assert dm.is_complete(dir_a)
    assert [p.name for p in cache.iterdir()] == [dm.DEFAULT_MODEL_NAME]
    # Built in other processes (other hash seeds), still byte-identical to the fixture's build.
    assert hashes_a == hashes_b == _hashes(model_dir)


def test_stale_incomplete_folder_is_replaced(model_dir: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DIST_INFER_CACHE", str(tmp_path))
    stale = tmp_path / dm.DEFAULT_MODEL_NAME
    stale.mkdir()
    (stale / "config.json").write_text("{}")  # e.g. a half-copied folder, no marker
    assert dm.default_model_dir() == str(stale)
    assert dm.is_complete(stale)
    assert _hashes(stale) == _hashes(model_dir)
    assert [p.name for p in tmp_path.iterdir()] == [dm.DEFAULT_MODEL_NAME]


def test_losing_the_rename_race_uses_the_winner(model_dir: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DIST_INFER_CACHE", str(tmp_path))
    target = tmp_path / dm.DEFAULT_MODEL_NAME
    real_build = dm.build_default_model

    def build_while_another_rank_wins(out_dir: str) -> None:
        real_build(out_dir)
        shutil.copytree(model_dir, target)  # the other process renamed its copy in first

    monkeypatch.setattr(dm, "build_default_model", build_while_another_rank_wins)
    assert dm.default_model_dir() == str(target)
    assert [p.name for p in tmp_path.iterdir()] == [dm.DEFAULT_MODEL_NAME]  # our tmp discarded


def test_hf_model_loads_and_gives_finite_logits(model_dir: str, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    assert model.dtype == torch.float32
    batch = tokenizer(["The lighthouse is", "Passage: Ada lives in Kyoto."], padding=True,
                      return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (*batch["input_ids"].shape, len(tokenizer))
    assert torch.isfinite(logits).all()
