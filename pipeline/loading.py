"""Read only this stage's tensors from a model folder (tokenizers: pipeline.tokenizer).

Weight layouts, tried in this order:

- ``model.safetensors.index.json`` + shards, or ``model.safetensors``. Read with plain positioned
  reads (no mmap): the header is parsed when a file is first needed, then each tensor is read on
  demand into its own buffer, so a stage's resident memory is its own weights plus one tensor.
- ``pytorch_model.bin.index.json`` + shards, or ``pytorch_model.bin``: ``torch.load(mmap=True,
  weights_only=True)``, so untouched tensors are never read (touched pages stay mapped until
  :meth:`TensorStore.close`).
- The seed's pre-split layout: ``pytorch_embs.pt`` (the embedding side: token embeddings, and the
  position table of learned-position models), ``pytorch_{i}.pt`` (layer ``i``) and
  ``pytorch_lm_head.pt`` (final norm + lm_head). Each file is a ``torch.save``'d dict holding the
  **HF tensor names** of its part, e.g. ``model.layers.1.self_attn.q_proj.weight`` in
  ``pytorch_1.pt``: what splitting an HF state dict by layer gives. With tied embeddings the
  embedding table is stored in both end files, so the last stage needs no ``pytorch_embs.pt``.
  A layer file may instead hold module-relative names (``self_attn.q_proj.weight``, as a
  ``layer.state_dict()`` gives). A stage opens only the files of its parts.
  :func:`split_checkpoint` writes this layout from any of the others.

The stage model is built on the meta device and each parameter is filled key by key with a shape
check: a missing, mis-shaped or unreadable tensor is a :class:`CheckpointError` naming the file
and the tensor, never a silent random init. ``TensorStore.loaded`` / ``opened_files`` record what
a stage actually read (tests assert on them).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from pathlib import Path

import torch

from tasks.files import atomic_path

from .models import DecoderSpec, Source, family_for, parameter_sources, spec_from_config
from .models.backends import choose_backend
from .models.hf_stage import HFStageModel, UnsupportedModel
from .models.decoder import StageModel
from .models.invariant import ROW_TILE
from .upload import Uploader

log = logging.getLogger(__name__)

EMBS, HEAD = "embs", "lm_head"  # the two non-layer parts of the pre-split layout
Part = int | str  # a layer index, EMBS or HEAD

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_AS_IS = Source([]).combine  # the default combine: the one tensor unchanged
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt)$|.*\.index\.json$")


class CheckpointError(ValueError):
    """The model folder cannot give a stage the tensors it needs."""


WEIGHT_LISTINGS = ("model.safetensors.index.json", "pytorch_model.bin.index.json", "model.safetensors",
                   "pytorch_model.bin", "pytorch_embs.pt")


def check_weights_present(model_dir: str | os.PathLike) -> None:
    """Fail (before any process starts, from the plan) when the folder holds no weights at all."""
    if not any((Path(model_dir) / name).is_file() for name in WEIGHT_LISTINGS):
        raise CheckpointError(
            f"{model_dir}: no weights found (expected model.safetensors, a sharded "
            "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json "
            "or the pre-split pytorch_embs.pt + pytorch_{i}.pt + pytorch_lm_head.pt)"
        )


def read_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json; --model-name must be a HuggingFace model folder")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read config: {e}") from e


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

    def _entry(self, name: str) -> tuple[int, int, torch.dtype, list[int]]:
        e = self.entries[name]
        begin, end = e["data_offsets"]
        dtype = _ST_DTYPES.get(e["dtype"])
        if dtype is None or end - begin != math.prod(e["shape"]) * dtype.itemsize:
            raise CheckpointError(f"{self.path}: tensor {name!r} has a bad entry {e} (dtype or byte count)")
        return self.base + begin, end - begin, dtype, e["shape"]

    def _read(self, name: str, offset: int, buf: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``buf`` with the bytes at ``offset``."""
        self.f.seek(offset)
        view = buf.view(-1).view(torch.uint8).numpy() if buf.numel() else bytearray()
        if self.f.readinto(view) != len(view):
            raise CheckpointError(f"{self.path}: truncated while reading tensor {name!r}")

    def __getitem__(self, name: str) -> torch.Tensor:
        offset, nbytes, dtype, shape = self._entry(name)
        buf = torch.empty(shape, dtype=dtype)
        self._read(name, offset, buf)
        return buf

    def read_into(self, name: str, out: torch.Tensor) -> bool:
        """Read tensor ``name`` straight into ``out`` if it is a contiguous CPU tensor of its dtype and shape."""
        offset, nbytes, dtype, shape = self._entry(name)
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
            if path.is_file():
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


def _embed_side(spec: DecoderSpec) -> set[str]:
    """Names of the embedding-side parameters of a StageModel (the rest of the non-layer ones are the head's)."""
    with torch.device("meta"):
        return {n for n, _ in StageModel(spec, 0, 0, True, False).named_parameters()}


def _part_of(param: str, first: int, embs: set[str]) -> Part:
    if param.startswith("layers."):
        return first + int(param.split(".")[1])
    return EMBS if param in embs else HEAD


def build_stage(
    model_dir: str | os.PathLike,
    first: int,
    last: int,
    has_embed: bool,
    has_head: bool,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    model_type: str | None = None,
    batch_invariant: bool = False,
    backend: str = "auto",
) -> tuple[StageModel | HFStageModel, TensorStore]:
    """Build a stage and fill it from the checkpoint, touching only the tensors it owns.

    ``backend`` (see :mod:`pipeline.models.backends`): native code for the family, or the generic
    stage built from transformers' own layers."""
    cfg = read_config(model_dir)
    if choose_backend(cfg, model_type, backend) == "transformers":
        if batch_invariant:
            raise UnsupportedModel("--batch-invariant needs the native code of a family; the generic transformers "
                                   "stage does not have its fixed-shape kernels (drop --batch-invariant)")
        return _build_hf_stage(model_dir, cfg, first, last, has_embed, has_head, dtype, device, model_type)
    family = family_for(cfg, model_type)
    spec: DecoderSpec = family.to_spec(cfg)
    with torch.device("meta"):
        model = StageModel(spec, first, last, has_embed, has_head, ROW_TILE if batch_invariant else 0)
    model = model.to(dtype).to_empty(device=device)  # cast on meta: storage only ever in the run's dtype
    store, up = TensorStore(model_dir), Uploader(device)
    embs = _embed_side(spec)
    params = dict(model.named_parameters())
    try:
        for name, source in parameter_sources(family, spec, model).items():
            part = _part_of(name, first, embs)
            source = store.layout(source, part)
            param = params[name]
            if len(source.names) == 1 and source.combine is _AS_IS:
                with torch.no_grad():  # the common case: no temporary when the stored dtype is the stage's
                    target = up.target(param.data)
                    tensors = [store.get(source.names[0], part, out=target)]
                    if tensors[0] is None:
                        up.commit(param.data, target)
                        continue
            else:
                tensors = [store.get(n, part) for n in source.names]
            files = ", ".join(sorted({str(store.file_of[n]) for n in source.names}))
            what = "+".join(source.names)
            try:
                value = source.combine(tensors)
            except RuntimeError as e:  # e.g. q/k/v of inconsistent widths
                raise CheckpointError(f"{files}: tensors {what} do not fit together for {name}: {e}") from e
            if tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{files}: tensor {what} has shape {tuple(value.shape)}, "
                    f"but {name} of this {spec.family} config needs {tuple(param.shape)}"
                )
            with torch.no_grad():
                up.put(param.data, value)  # casts to the stage dtype without another temporary
            del tensors, value
        up.finish()
    finally:
        store.close()
    model.init_buffers()
    model.eval().requires_grad_(False)
    log.info("loaded %d tensors from %d files for layers [%d, %d) embed=%s head=%s",
             len(store.loaded), len(store.opened_files), first, last, has_embed, has_head)
    return model, store


def _first_present(store: TensorStore, names: list[str], part: Part, out: torch.Tensor | None = None):
    """(name, tensor) of the first of ``names`` the checkpoint has (e.g. the tied embedding table,
    else lm_head.weight); the last one's error if none."""
    for name in names:
        try:
            return name, store.get(name, part, out=out)
        except CheckpointError:
            if name == names[-1]:
                raise


def _build_hf_stage(model_dir, cfg: dict, first: int, last: int, has_embed: bool, has_head: bool, dtype, device,
                    model_type: str | None):
    """The generic stage (:class:`~pipeline.models.hf_stage.HFStageModel`), filled tensor by tensor."""
    from .models.hf_stage import hf_config

    model = HFStageModel(hf_config(cfg, model_type), first, last, has_embed, has_head)
    model = model.materialize(device, dtype)
    store, up = TensorStore(model_dir), Uploader(device)
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(model.named_buffers())
    try:
        for name, (candidates, kind) in model.checkpoint_names().items():
            param = params[name]
            part = {"embs": EMBS, "head": HEAD}.get(kind) or first + int(name.split(".")[1])
            with torch.no_grad():
                target = up.target(param.data)
                hf_name, value = _first_present(store, candidates, part, out=target)
                if value is None:
                    up.commit(param.data, target)
                    continue
                if tuple(value.shape) != tuple(param.shape):
                    raise CheckpointError(f"{store.file_of[hf_name]}: tensor {hf_name!r} has shape "
                                          f"{tuple(value.shape)}, but {cfg.get('model_type')} needs "
                                          f"{tuple(param.shape)}")
                up.put(param.data, value)
        up.finish()
    finally:
        store.close()
    model.tie()
    model.init_buffers()
    model.eval().requires_grad_(False)
    log.info("generic stage: loaded %d tensors from %d files for layers [%d, %d) embed=%s head=%s",
             len(store.loaded), len(store.opened_files), first, last, has_embed, has_head)
    return model, store


def split_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike,
                     model_type: str | None = None) -> list[Path]:
    """Write ``model_dir``'s weights in the pre-split layout into ``out_dir`` (one part in memory at a time).

    Non-weight files (config, tokenizer, generation config) are copied along, so ``out_dir`` is a
    complete model folder. Tensors no parameter uses (e.g. saved rotary buffers) are left out.
    Returns the written weight files.
    """
    cfg = read_config(model_dir)
    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    store = TensorStore(src)
    if choose_backend(cfg, model_type) == "native":
        family = family_for(cfg, model_type)
        spec = family.to_spec(cfg)
        num_layers = spec.num_layers

        def part_names(shape, part) -> list[list[str]]:
            with torch.device("meta"):
                model = StageModel(spec, *shape)
            sources = [store.layout(s, part) for s in parameter_sources(family, spec, model).values()]
            return [[n] for n in dict.fromkeys(n for s in sources for n in s.names)]
    else:  # the generic stage: HF names straight from transformers' modules
        from .models.hf_stage import hf_config

        config = hf_config(cfg, model_type)
        num_layers = config.num_hidden_layers

        def part_names(shape, part) -> list[list[str]]:
            return [names for names, _ in HFStageModel(config, *shape).checkpoint_names().values()]

    layout = [(EMBS, (0, 0, True, False)), *[(i, (i, i + 1, False, False)) for i in range(num_layers)],
              (HEAD, (0, 0, False, True))]
    written = []
    for part, shape in layout:
        tensors = {}
        for candidates in part_names(shape, part):
            name, tensor = _first_present(store, candidates, part)
            tensors[name] = tensor.contiguous().clone()  # own, compact storage
        path = out / f"pytorch_{part}.pt"
        with atomic_path(path) as tmp:
            torch.save(tensors, tmp)
        written.append(path)
    store.close()
    if src.resolve() != out.resolve():
        for f in src.iterdir():
            if f.is_file() and not _WEIGHT_FILES.fullmatch(f.name):
                shutil.copy2(f, out / f.name)
    return written


__all__ = ["CheckpointError", "SafetensorsFile", "TensorStore", "build_stage", "read_config", "spec_from_config",
           "split_checkpoint"]
