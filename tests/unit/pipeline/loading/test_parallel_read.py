"""pipeline.loading.parallel_read: chunks read straight into parameters on threads, cast while reading."""

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.loading.parallel_read import ParallelReader
from pipeline.loading.stage_weights import build_stage
from pipeline.loading.tensor_store import CheckpointError, TensorStore
from tests.utils import tiny_llama


@pytest.fixture()
def store(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(37, 29, generator=gen).to(torch.bfloat16),  # odd sizes: chunks split mid-row
               "b": torch.randn(1000, generator=gen),
               "q": torch.randn(6, 8, generator=gen).to(torch.bfloat16),
               "k": torch.randn(2, 8, generator=gen).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    s = TensorStore(tmp_path)
    yield s, tensors
    s.close()


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])  # bytes: tensors spanning many chunks, and one chunk each
def test_same_dtype_and_cast_are_exact(store, threads, chunk):
    s, tensors = store
    reader = ParallelReader(threads, chunk)
    same = torch.empty(37, 29, dtype=torch.bfloat16)
    cast = torch.empty(37, 29, dtype=torch.float32)  # bf16 -> float32 while reading
    down = torch.empty(1000, dtype=torch.bfloat16)  # float32 -> bf16 while reading
    try:
        assert s.fill("a", None, same, reader) and s.fill("a", None, cast, reader) and s.fill("b", None, down, reader)
        reader.wait()
    finally:
        reader.close()
    assert torch.equal(same.view(torch.int16), tensors["a"].view(torch.int16))  # bit-identical
    assert torch.equal(cast, tensors["a"].to(torch.float32))
    assert torch.equal(down.view(torch.int16), tensors["b"].to(torch.bfloat16).view(torch.int16))
    assert s.loaded == ["a", "a", "b"]


def test_row_blocks_of_one_parameter(store):
    """Fused q/k: each stored piece read into its row block, equal to torch.cat of the pieces."""
    s, tensors = store
    reader = ParallelReader(2, 16)
    out = torch.empty(8, 8, dtype=torch.float32)
    assert s.fill("q", None, out.narrow(0, 0, 6), reader) and s.fill("k", None, out.narrow(0, 6, 2), reader)
    reader.wait()
    reader.close()
    assert torch.equal(out, torch.cat([tensors["q"], tensors["k"]]).float())


def test_what_it_does_not_read(store):
    s, _ = store
    reader = ParallelReader(1)
    assert not s.fill("a", None, torch.empty(29, 37, dtype=torch.bfloat16), reader)  # shape differs
    assert not s.fill("a", None, torch.empty(29, 37).t(), reader)  # not contiguous
    assert not s.fill("a", None, torch.empty(37, 29, dtype=torch.int8), reader)  # int8: quantized elsewhere
    with pytest.raises(CheckpointError, match="'zz' is missing"):
        s.fill("zz", None, torch.empty(1), reader)
    reader.close()
    assert s.loaded == []


def test_file_truncated_after_its_header_was_checked(store, tmp_path):
    s, tensors = store
    s.stored_shape("a")  # opens the file, header checked against its full size
    handle = s._open(tmp_path / "model.safetensors", None)
    last = max(tensors, key=lambda n: handle.locate(n)[0])  # the tensor stored last loses its end
    path = tmp_path / "model.safetensors"
    os.truncate(path, os.path.getsize(path) - 10)
    reader = ParallelReader(2, 64)
    assert s.fill(last, None, torch.empty_like(tensors[last]), reader)
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor '{last}': truncated while reading"):
        reader.wait()
    reader.close()


def test_truncated_file_is_refused_at_open(tmp_path):
    save_file({"a": torch.zeros(100)}, str(tmp_path / "model.safetensors"))
    os.truncate(tmp_path / "model.safetensors", os.path.getsize(tmp_path / "model.safetensors") - 8)
    with pytest.raises(CheckpointError, match=r"truncated: tensor 'a' ends at byte"):
        TensorStore(tmp_path)


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stage_equals_the_checkpoint_read_plainly(tmp_path, stored, dtype):
    """A whole stage (fused q/k/v and gate/up, embeddings, head) through the threaded reader equals
    each stored tensor read with safetensors and cast with torch's .to()."""
    model_dir = Path(tiny_llama(tmp_path / "m"))
    ref = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        part = {k: v.to(stored).contiguous() for k, v in load_file(str(f)).items()}
        save_file(part, str(f), metadata={"format": "pt"})
        ref.update(part)
    model, store = build_stage(model_dir, 0, 2, True, True, dtype)
    store.close()
    params = dict(model.named_parameters())
    q, k, v = (ref[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(params["layers.1.attn.qkv.weight"], torch.cat([q, k, v]).to(dtype))
    gate, up = ref["model.layers.0.mlp.gate_proj.weight"], ref["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(params["layers.0.mlp.up.weight"], torch.cat([gate, up]).to(dtype))
    assert torch.equal(params["embed.weight"], ref["model.embed_tokens.weight"].to(dtype))
    assert len(store.loaded) == len(set(store.loaded))
