"""Tensors read from a model folder on demand: :class:`SafetensorsFile` (positioned reads of one
safetensors file) and :class:`TensorStore` (every layout :mod:`pipeline.loading.stage_weights` knows, recording
what a stage read), and the :class:`CheckpointError` they raise."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch

from pipeline.models.families import Source

EMBS, HEAD = "embs", "lm_head"  # the two non-layer parts of the pre-split layout
Part = int | str  # a layer index, EMBS or HEAD

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointError(ValueError):
    """The model folder cannot give a stage the tensors it needs."""


WEIGHT_LISTINGS = ("model.safetensors.index.json", "pytorch_model.bin.index.json", "model.safetensors",
                   "pytorch_model.bin", "pytorch_embs.pt")


class SafetensorsFile:
    """One .safetensors file: header parsed and checked at open, tensors read on demand (no mmap)."""

    def __init__(self, path: Path):
        self.path = path
        self.f = open(path, "rb")
        try:
            self._read_header()
        except BaseException:
            self.f.close()
            raise

    def _read_header(self) -> None:
        path = self.path
        size = os.fstat(self.f.fileno()).st_size
        n = int.from_bytes(self.f.read(8), "little") if size >= 8 else -1
        if n < 0 or 8 + n > size:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, header incomplete)")
        header = json.loads(self.f.read(n))
        header.pop("__metadata__", None)
        self.base, self.entries = 8 + n, header
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][1]):
            if self.base + e["data_offsets"][1] > size:
                raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte "
                                      f"{self.base + e['data_offsets'][1]} but the file has {size} bytes")

    def keys(self):
        return self.entries.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def locate(self, name: str) -> tuple[int, torch.dtype, list[int]]:
        """(absolute byte offset, stored dtype, shape) of tensor ``name``, its entry checked."""
        e = self.entries[name]
        begin, end = e["data_offsets"]
        dtype = _ST_DTYPES.get(e["dtype"])
        if dtype is None or end - begin != math.prod(e["shape"]) * dtype.itemsize:
            raise CheckpointError(f"{self.path}: tensor {name!r} has a bad entry {e} (dtype or byte count)")
        return self.base + begin, dtype, e["shape"]

    def _read(self, name: str, offset: int, buf: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``buf`` with the bytes at ``offset``."""
        self.f.seek(offset)
        view = buf.view(-1).view(torch.uint8).numpy() if buf.numel() else bytearray()
        if self.f.readinto(view) != len(view):
            raise CheckpointError(f"{self.path}: truncated while reading tensor {name!r}")

    def __getitem__(self, name: str) -> torch.Tensor:
        offset, dtype, shape = self.locate(name)
        buf = torch.empty(shape, dtype=dtype)
        self._read(name, offset, buf)
        return buf

    def read_into(self, name: str, out: torch.Tensor) -> bool:
        """Read tensor ``name`` straight into ``out`` if it is a contiguous CPU tensor of its dtype and shape."""
        offset, dtype, shape = self.locate(name)
        if out.device.type != "cpu" or not out.is_contiguous() or out.dtype != dtype or list(out.shape) != shape:
            return False
        self._read(name, offset, out)
        return True

    def close(self) -> None:
        self.f.close()


class TensorStore:
    """Lazy access to a checkpoint's tensors by HF name; remembers which tensors and files were read."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        # a hub snapshot (pipeline.loading.hub.ModelSource) fetches a file when first opened: a stage
        # downloads only the shards of its own layers
        self.fetch = getattr(model_dir, "fetch", None)
        self.file_of: dict[str, Path] = {}  # HF name -> file (pre-split: filled as tensors are read)
        self.loaded: list[str] = []  # accounting: HF names this stage actually read
        self.opened_files: list[Path] = []  # accounting: weight files this stage opened, in order
        self.listing: Path | None = None  # the file that lists every tensor (index or single file)
        self.stored_as: dict[str, str] = {}  # HF name -> the name it is stored under, once read
        self.pre_split = False
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
                self.listing = index
                return
        for single in ("model.safetensors", "pytorch_model.bin"):
            path = self.dir / single
            if path.is_file() or (self.fetch and self.fetch(single)):
                self.file_of = {k: path for k in self._open(path, None).keys()}
                self.listing = path
                return
        if (self.dir / "pytorch_embs.pt").is_file():
            self.pre_split = True
            return
        check_weights_present(self.dir)

    def _open(self, path: Path, wanted: str | None):
        """The open file (SafetensorsFile or an mmap'd state dict); ``wanted`` names the tensor for errors."""
        if path not in self._handles:
            need = f" (needed for tensor {wanted!r})" if wanted else ""
            if not path.is_file() and self.fetch and path.parent == self.dir:
                self.fetch(path.name)
            if not path.is_file():
                what = f"listed in {self.listing.name}" if self.listing else "of the pre-split layout"
                raise CheckpointError(f"{path}: checkpoint file {what} is missing{need}")
            self.opened_files.append(path)
            try:
                if path.suffix == ".safetensors":
                    handle = SafetensorsFile(path)
                else:
                    handle = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
                    if not isinstance(handle, dict):
                        raise CheckpointError(f"{path}: expected a dict of tensors, found {type(handle).__name__}")
            except CheckpointError as e:
                raise CheckpointError(f"{e}{need}") from None
            except Exception as e:  # torch.load raises RuntimeError/pickle errors on truncated files
                raise CheckpointError(f"{path}: cannot open checkpoint file{need}: {e}") from e
            self._handles[path] = handle
        return self._handles[path]

    def _resolve(self, name: str) -> str:
        """The stored name of HF tensor ``name``. Older or hub-exported checkpoints often lack the
        base-model prefix that transformers' save_pretrained writes (``h.0.attn...`` for
        ``transformer.h.0.attn...``, ``decoder.layers...`` for ``model.decoder.layers...``), and a
        vision-language checkpoint keeps its text decoder under ``language_model.`` (Gemma 3 4B+:
        ``language_model.model.layers...``; ``model.language_model.layers...`` in newer exports)."""
        bare = name.split(".", 1)[1] if "." in name else name
        for key in (self.stored_as.get(name), name, bare, "language_model." + name, "model.language_model." + bare):
            if key in self.file_of:
                return key
        raise CheckpointError(f"{self.listing}: tensor {name!r} is missing from the checkpoint")

    def has(self, name: str, part: Part | None = None) -> bool:
        """Whether tensor ``name`` is stored (pre-split: in ``part``'s file, which this opens; a missing
        or unreadable file is an error of its own, not an absent tensor)."""
        if self.pre_split and part is not None:
            self._open(self.dir / f"pytorch_{part}.pt", name)
        try:
            if self.pre_split:
                self._locate_pre_split(name, part)
            else:
                self._resolve(name)
        except CheckpointError:
            return False
        return True

    def layout(self, source: Source, part: Part | None = None) -> Source:
        """The first of ``source``'s layouts (itself, then its fallbacks) whose tensors are all stored;
        a source without fallbacks as is (reading it names a missing tensor)."""
        if source.fallback is None:
            return source
        layouts = source.layouts()
        for s in layouts:
            if all(self.has(n, part) for n in s.names):
                return s
        missing = [next(n for n in s.names if not self.has(n, part)) for s in layouts]
        where = self.listing or self.dir / f"pytorch_{part}.pt"
        raise CheckpointError(f"{where}: none of the checkpoint layouts of this tensor is complete: "
                              f"missing {' / '.join(repr(n) for n in missing)}")

    def get(self, name: str, part: Part | None = None, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Tensor ``name``; ``part`` (layer index, EMBS or HEAD) picks the file of a pre-split layout.

        With ``out`` (a CPU tensor of the stored dtype and shape) a safetensors tensor is read straight
        into it and None is returned; otherwise the tensor is returned.
        """
        if self.pre_split:
            path, key = self._locate_pre_split(name, part)
        else:
            key = self._resolve(name)
            path = self.file_of[key]
        handle = self._open(path, name)
        try:
            if out is not None and isinstance(handle, SafetensorsFile) and handle.read_into(key, out):
                tensor = None
            else:
                tensor = handle[key]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r}: {e}") from e
        self.file_of[name] = path
        if not self.pre_split:
            self.stored_as[name] = key
        self.loaded.append(name)
        return tensor

    def stored_shape(self, name: str, part: Part | None = None) -> list[int] | None:
        """The shape of safetensors tensor ``name`` from its file's header (None in another layout)."""
        if self.pre_split:
            return None
        key = self._resolve(name)
        handle = self._open(self.file_of[key], name)
        return handle.locate(key)[2] if isinstance(handle, SafetensorsFile) else None

    def fill(self, name: str, part: Part | None, out: torch.Tensor, reader) -> bool:
        """Queue tensor ``name`` to be read into ``out`` on ``reader`` (a
        :class:`~pipeline.loading.parallel_read.ParallelReader`; ``reader.wait()`` completes it): when
        it is stored in a safetensors file with ``out``'s shape, ``out`` is a contiguous CPU tensor and
        both dtypes are floating point (a differing one is cast chunk by chunk). False otherwise
        (another layout or dtype, a mismatched shape): read it with :meth:`get`, which names the problem."""
        if self.pre_split or out.device.type != "cpu" or not out.is_contiguous() or not out.is_floating_point():
            return False
        key = self._resolve(name)
        path = self.file_of[key]
        handle = self._open(path, name)
        if not isinstance(handle, SafetensorsFile):
            return False
        offset, dtype, shape = handle.locate(key)
        if list(out.shape) != list(shape) or not dtype.is_floating_point:
            return False
        reader.submit(handle.f.fileno(), offset, dtype, out, f"{path}: tensor {name!r}")
        self.file_of[name] = path
        self.stored_as[name] = key
        self.loaded.append(name)
        return True

    def _locate_pre_split(self, name: str, part: Part | None) -> tuple[Path, str]:
        if part is None:
            m = re.search(r"\.(\d+)\.", name)
            part = int(m.group(1)) if m else EMBS
        path = self.dir / f"pytorch_{part}.pt"
        handle = self._open(path, name)
        if name in handle:
            return path, name
        if isinstance(part, int):  # a layer file may hold module-relative names
            key = name.split(f".{part}.", 1)[-1]
            if key in handle:
                return path, key
        else:  # tied embeddings stored only once: look in the other end file
            other = self.dir / f"pytorch_{HEAD if part == EMBS else EMBS}.pt"
            if other.is_file() and name in self._open(other, name):
                return other, name
        raise CheckpointError(f"{path}: tensor {name!r} is missing from the checkpoint")

    def close(self) -> None:
        """Drop open files and mappings (accounting is kept)."""
        for h in self._handles.values():
            if isinstance(h, SafetensorsFile):
                h.close()
        self._handles.clear()


def check_weights_present(model_dir: str | os.PathLike) -> None:
    """Fail (before any process starts, from the plan) when the folder holds no weights at all."""
    if not any((Path(model_dir) / name).is_file() for name in WEIGHT_LISTINGS):
        raise CheckpointError(
            f"{model_dir}: no weights found (expected model.safetensors, a sharded "
            "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json "
            "or the pre-split pytorch_embs.pt + pytorch_{i}.pt + pytorch_lm_head.pt)"
        )
