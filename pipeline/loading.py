"""Read only this stage's tensors from a HuggingFace model folder.

Supported layouts: ``model.safetensors``; sharded safetensors with ``model.safetensors.index.json``;
``pytorch_model.bin`` and sharded ``.bin`` with ``pytorch_model.bin.index.json`` (loaded with
``weights_only=True`` and ``mmap=True``, so untouched tensors are never read into memory).
The stage model is built on the meta device and each parameter is filled key by key with a shape
check: a missing or mis-shaped tensor is an error naming it, never a silent random init.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from .models import DecoderSpec, family_for, parameter_sources, spec_from_config
from .models.decoder import StageModel

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """The model folder cannot give a stage the tensors it needs."""


def read_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json; --model-name must be a HuggingFace model folder")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read config: {e}") from e


class TensorStore:
    """Lazy access to a checkpoint's tensors by HF name; remembers which tensors were read."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        self.file_of: dict[str, Path] = {}
        self.loaded: list[str] = []  # accounting: HF names this stage actually read
        self._handles: dict[Path, object] = {}
        self._index()

    def _index(self) -> None:
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = self.dir / index_name
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (OSError, ValueError, KeyError) as e:
                    raise CheckpointError(f"{index}: unreadable shard index: {e}") from e
                self.file_of = {k: self.dir / v for k, v in weight_map.items()}
                return
        for single in ("model.safetensors", "pytorch_model.bin"):
            path = self.dir / single
            if path.is_file():
                self.file_of = {k: path for k in self._open(path).keys()}
                return
        raise CheckpointError(
            f"{self.dir}: no weights found (expected model.safetensors, a sharded "
            "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json)"
        )

    def _open(self, path: Path):
        if path not in self._handles:
            if not path.is_file():
                raise CheckpointError(f"{path}: checkpoint shard listed in the index is missing")
            try:
                if path.suffix == ".safetensors":
                    from safetensors import safe_open

                    self._handles[path] = safe_open(str(path), framework="pt")
                else:
                    self._handles[path] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:  # safetensors raises its own error types on truncation
                raise CheckpointError(f"{path}: cannot open checkpoint file: {e}") from e
        return self._handles[path]

    def get(self, name: str) -> torch.Tensor:
        if name not in self.file_of:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        path = self.file_of[name]
        handle = self._open(path)
        try:
            tensor = handle.get_tensor(name) if path.suffix == ".safetensors" else handle[name]
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r}: {e}") from e
        self.loaded.append(name)
        return tensor


def build_stage(
    model_dir: str | os.PathLike,
    first: int,
    last: int,
    has_embed: bool,
    has_head: bool,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    model_type: str | None = None,
) -> tuple[StageModel, TensorStore]:
    """Build a stage and fill it from the checkpoint, touching only the tensors it owns."""
    cfg = read_config(model_dir)
    family = family_for(cfg, model_type)
    spec: DecoderSpec = family.to_spec(cfg)
    with torch.device("meta"):
        model = StageModel(spec, first, last, has_embed, has_head)
    model = model.to_empty(device=device).to(dtype)
    store = TensorStore(model_dir)
    params = dict(model.named_parameters())
    for name, source in parameter_sources(family, spec, model).items():
        tensors = [store.get(n) for n in source.names]
        value = source.combine(tensors)
        param = params[name]
        if tuple(value.shape) != tuple(param.shape):
            files = sorted({str(store.file_of[n]) for n in source.names})
            raise CheckpointError(
                f"{', '.join(files)}: tensor {'+'.join(source.names)} has shape {tuple(value.shape)}, "
                f"but {name} of this {spec.family} config needs {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(value.to(dtype))
    model.init_buffers()
    model.eval().requires_grad_(False)
    log.info("loaded %d tensors for layers [%d, %d) embed=%s head=%s", len(store.loaded), first, last, has_embed, has_head)
    return model, store


__all__ = ["CheckpointError", "TensorStore", "build_stage", "read_config", "spec_from_config"]
