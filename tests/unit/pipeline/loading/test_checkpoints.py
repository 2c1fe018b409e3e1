"""Checkpoint formats load lazily and identically; broken checkpoints fail naming the file and tensor."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.loading.stage_weights import CheckpointError, build_stage, split_checkpoint
from pipeline.config.partition import stage_ranges
from tests.utils import llama_stage_tensors, chain_logits, hf_logits, local_tokenizer, stage_chain, tiny_llama

PROMPTS = [[5, 17, 300, 42, 9, 11], [100, 200, 7]]
FORMATS = ["safetensors", "safetensors-sharded", "bin", "bin-sharded", "pre-split"]


def _copy_meta(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix in (".json", ".jinja") and "index" not in f.name:
            shutil.copy2(f, dst / f.name)


def _save_bin(state: dict, dst: Path, shards: int) -> None:
    """The legacy .bin layouts (transformers 5 save_pretrained always writes safetensors)."""
    if shards == 1:
        torch.save(state, dst / "pytorch_model.bin")
        return
    names = list(state)
    weight_map = {}
    for s in range(shards):
        file = f"pytorch_model-{s + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n] for n in names[s::shards]}
        torch.save(part, dst / file)
        weight_map.update(dict.fromkeys(part, file))
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """The same random 3-layer Llama in every supported layout."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("formats")
    base = Path(tiny_llama(root / "safetensors"))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.save_pretrained(root / "safetensors-sharded", max_shard_size="300KB")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name, shards in (("bin", 1), ("bin-sharded", 3)):
        _copy_meta(base, root / name)
        _save_bin(state, root / name, shards)
    split_checkpoint(base, root / "pre-split")
    return {name: root / name for name in FORMATS}


def test_layouts_are_what_they_claim(formats):
    assert len(list(formats["safetensors-sharded"].glob("model-*.safetensors"))) >= 3
    assert (formats["bin"] / "pytorch_model.bin").is_file()
    assert len(list(formats["bin-sharded"].glob("pytorch_model-*.bin"))) == 3
    names = sorted(p.name for p in formats["pre-split"].glob("*.pt"))
    assert names == ["pytorch_0.pt", "pytorch_1.pt", "pytorch_2.pt", "pytorch_embs.pt", "pytorch_lm_head.pt"]
    for f in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (formats["pre-split"] / f).is_file()
    layer1 = torch.load(formats["pre-split"] / "pytorch_1.pt", weights_only=True)
    assert all(k.startswith("model.layers.1.") for k in layer1) and len(layer1) == 9


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_gives_identical_stage_outputs(formats, fmt):
    ranges = stage_ranges(3, 2)
    ref = chain_logits(stage_chain(str(formats["safetensors"]), ranges), PROMPTS)
    ours = chain_logits(stage_chain(str(formats[fmt]), ranges), PROMPTS)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)
    if fmt == "safetensors":
        torch.testing.assert_close(ref[0], hf_logits(str(formats[fmt]), PROMPTS[0]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["auto", "transformers"])  # native code, and the generic stage
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("first_last", [(False, False), (True, False), (False, True)])
def test_middle_layers_read_only_their_tensors(formats, fmt, first_last, backend):
    has_embed, has_head = first_last
    _, store = build_stage(formats[fmt], 1, 2, has_embed, has_head, backend=backend)
    expected = llama_stage_tensors(1, has_embed, has_head)
    assert sorted(store.loaded) == sorted(expected)
    if fmt == "pre-split":
        files = ["pytorch_embs.pt"] * has_embed + ["pytorch_1.pt"] + ["pytorch_lm_head.pt"] * has_head
        assert sorted(p.name for p in store.opened_files) == sorted(files)
    elif fmt == "safetensors-sharded":
        index = json.loads((formats[fmt] / "model.safetensors.index.json").read_text())["weight_map"]
        assert {p.name for p in store.opened_files} == {index[n] for n in expected}


@pytest.fixture(scope="module")
def moe_formats(tmp_path_factory):
    """A random 3-layer Qwen2-MoE (8 experts per routed layer, a shared expert, layer 1 dense) as
    save_pretrained writes it (one tensor per expert), sharded, and pre-split."""
    from transformers import AutoModelForCausalLM

    from tests.unit.pipeline.models.families.test_moe import tiny_moe

    root = tmp_path_factory.mktemp("moe")
    base = Path(tiny_moe(root / "safetensors", "qwen2_moe"))
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).save_pretrained(
        root / "safetensors-sharded", max_shard_size="200KB")
    split_checkpoint(base, root / "pre-split")
    return {name: root / name for name in ("safetensors", "safetensors-sharded", "pre-split")}


@pytest.mark.parametrize("fmt", ["safetensors", "safetensors-sharded", "pre-split"])
@pytest.mark.parametrize("first,last", [(0, 1), (1, 2), (2, 3)])
def test_moe_stage_reads_only_its_layers_experts(moe_formats, fmt, first, last):
    """Every tensor of its own layers (all 8 experts of a routed layer, or the dense MLP) and nothing else."""
    from safetensors import safe_open

    with safe_open(moe_formats["safetensors"] / "model.safetensors", "pt") as f:
        stored = list(f.keys())
    _, store = build_stage(moe_formats[fmt], first, last, False, False)
    expected = {n for n in stored if n.startswith(f"model.layers.{first}.")}
    assert sorted(store.loaded) == sorted(expected)
    experts = {n for n in expected if ".mlp.experts." in n}
    assert len(experts) == (0 if first == 1 else 8 * 3)  # layer 1 is in mlp_only_layers
    if fmt == "pre-split":
        assert [p.name for p in store.opened_files] == [f"pytorch_{first}.pt"]
    elif fmt == "safetensors-sharded":
        index = json.loads((moe_formats[fmt] / "model.safetensors.index.json").read_text())["weight_map"]
        assert len(set(index.values())) >= 3
        assert {p.name for p in store.opened_files} == {index[n] for n in expected}


@pytest.mark.parametrize("backend", ["auto", "transformers"])
def test_pre_split_tied_embeddings_last_stage_needs_no_embs_file(tmp_path, backend):
    d = tiny_llama(tmp_path / "tied", tie_word_embeddings=True, num_hidden_layers=2)
    split_checkpoint(d, tmp_path / "split")
    _, store = build_stage(tmp_path / "split", 1, 2, False, True, backend=backend)
    assert sorted(p.name for p in store.opened_files) == ["pytorch_1.pt", "pytorch_lm_head.pt"]
    for a, b in zip(chain_logits(stage_chain(str(tmp_path / "split"), [(0, 1), (1, 2)], backend=backend), PROMPTS),
                    chain_logits(stage_chain(d, [(0, 2)], backend=backend), PROMPTS), strict=True):
        assert torch.equal(a, b)


def test_pre_split_learned_positions_go_to_embs(tmp_path):
    """GPT-2 style: the position table is part of pytorch_embs.pt."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.utils import save_hf_model

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(local_tokenizer()), n_embd=32, n_layer=2, n_head=4, n_positions=64)
    d = save_hf_model(GPT2LMHeadModel(cfg).eval(), tmp_path / "gpt2")
    split_checkpoint(d, tmp_path / "split")
    embs = torch.load(tmp_path / "split" / "pytorch_embs.pt", weights_only=True)
    assert set(embs) == {"transformer.wte.weight", "transformer.wpe.weight"}
    for a, b in zip(chain_logits(stage_chain(str(tmp_path / "split"), [(0, 1), (1, 2)]), PROMPTS),
                    chain_logits(stage_chain(d, [(0, 2)]), PROMPTS), strict=True):
        assert torch.equal(a, b)


def test_pre_split_module_relative_layer_names(formats, tmp_path):
    """A layer file holding ``layer.state_dict()`` names (no model.layers.i. prefix) loads too."""
    d = tmp_path / "relative"
    shutil.copytree(formats["pre-split"], d)
    t = torch.load(d / "pytorch_1.pt", weights_only=True)
    torch.save({k.removeprefix("model.layers.1."): v for k, v in t.items()}, d / "pytorch_1.pt")
    model, _ = build_stage(d, 1, 2, False, False)
    ref, _ = build_stage(formats["safetensors"], 1, 2, False, False)
    for (n, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


# ---- broken checkpoints ----

def _broken(formats, tmp_path, fmt: str) -> Path:
    d = tmp_path / fmt
    shutil.copytree(formats[fmt], d)
    return d


def _expect_error(model_dir, *fragments, first=0, last=3):
    with pytest.raises(CheckpointError) as e:
        build_stage(model_dir, first, last, first == 0, last == 3)
    for f in fragments:
        assert str(f) in str(e.value), str(e.value)
    return str(e.value)


def test_missing_tensor(formats, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _broken(formats, tmp_path, "safetensors")
    state = load_file(d / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    _expect_error(d, d / "model.safetensors", "'model.layers.1.self_attn.k_proj.weight'", "missing")
    build_stage(d, 2, 3, False, True)  # stages that do not need it still load


def test_wrong_shape(tmp_path):
    d = Path(tiny_llama(tmp_path / "h32", hidden_size=32))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "hidden_size": 64}))
    msg = _expect_error(d, d / "model.safetensors", "model.layers.1.input_layernorm.weight", first=1, last=2)
    assert "(32,)" in msg and "(64,)" in msg
    _expect_error(d, d / "model.safetensors", "model.embed_tokens.weight", "32)", "64)", first=0, last=1)


def test_truncated_safetensors(formats, tmp_path):
    d = _broken(formats, tmp_path, "safetensors")
    f = d / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    _expect_error(d, f, "truncated", "tensor '")


def test_shard_missing(formats, tmp_path):
    d = _broken(formats, tmp_path, "safetensors-sharded")
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.layers.2.mlp.down_proj.weight"]
    (d / shard).unlink()
    msg = _expect_error(d, d / shard, "missing")
    assert any(f"tensor {n!r}" in msg for n, f in index.items() if f == shard), msg


def test_truncated_bin(formats, tmp_path):
    d = _broken(formats, tmp_path, "bin")
    f = d / "pytorch_model.bin"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    with pytest.raises(CheckpointError) as e:
        build_stage(d, 0, 3, True, True)
    assert str(f) in str(e.value)


def test_truncated_bin_shard_names_the_tensor(formats, tmp_path):
    d = _broken(formats, tmp_path, "bin-sharded")
    index = json.loads((d / "pytorch_model.bin.index.json").read_text())["weight_map"]
    f = d / index["model.layers.1.mlp.up_proj.weight"]
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    _expect_error(d, f, "tensor '")


def test_pre_split_layer_file_missing(formats, tmp_path):
    d = _broken(formats, tmp_path, "pre-split")
    (d / "pytorch_2.pt").unlink()
    build_stage(d, 0, 2, True, False)
    _expect_error(d, d / "pytorch_2.pt", "'model.layers.2.", "missing", first=2, last=3)


def test_checkpoint_without_base_model_prefix_loads(tmp_path):
    """Hub-exported GPT-2/BLOOM/OPT files often store ``h.0...`` for ``transformer.h.0...``."""
    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.utils import chain_logits, local_tokenizer, save_hf_model, stage_chain

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(local_tokenizer()), n_embd=32, n_layer=2, n_head=4, n_positions=64)
    ref_dir = save_hf_model(GPT2LMHeadModel(cfg).eval(), tmp_path / "ref")
    bare_dir = tmp_path / "bare"
    bare_dir.mkdir()
    for f in Path(ref_dir).iterdir():
        if f.name != "model.safetensors":
            (bare_dir / f.name).write_bytes(f.read_bytes())
    tensors = load_file(Path(ref_dir) / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, bare_dir / "model.safetensors",
              metadata={"format": "pt"})
    prompts = [[5, 6, 7, 8], [9, 10]]
    a = chain_logits(stage_chain(ref_dir, [(0, 1), (1, 2)]), prompts)
    b = chain_logits(stage_chain(str(bare_dir), [(0, 1), (1, 2)]), prompts)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("tied", [True, False])
def test_a_stage_with_embedding_and_head_holds_a_tied_table_once(tmp_path, tied):
    """Tied embeddings on a stage holding both ends: the head multiplies by the embedding table itself
    (one tensor in memory, filled once), and the logits are still HF's; untied, two tables; a split
    model's stages each hold their own end."""
    d = tiny_llama(tmp_path / "m", tie_word_embeddings=tied)
    model, _ = build_stage(d, 0, 3, True, True)
    assert (model.lm_head.weight is model.embed.weight) == tied
    tensors = {p.data_ptr() for p in model.parameters()}
    assert len(tensors) == len(dict(model.named_parameters(remove_duplicate=False))) - tied
    prompt = [1, 5, 9, 14]
    chain = stage_chain(d, [(0, 3)])
    torch.testing.assert_close(chain_logits(chain, [prompt])[0], hf_logits(d, prompt), atol=1e-4, rtol=1e-4)
    first, _ = build_stage(d, 0, 2, True, False)
    last, _ = build_stage(d, 2, 3, False, True)
    assert first.lm_head is None and last.embed is None
    torch.testing.assert_close(last.lm_head.weight, model.lm_head.weight)
