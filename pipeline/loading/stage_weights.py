"""Read only this stage's tensors from a model folder (tokenizers: pipeline.loading.tokenizer).

Layouts (docs/usage/models.md): safetensors (single or sharded), read with positioned reads straight
into the parameters (:mod:`pipeline.loading.parallel_read` on a CPU, a pinned buffer on a GPU:
:mod:`pipeline.loading.upload`), so a stage's resident memory is its own weights plus a chunk per
thread; ``.bin`` (single or sharded) by ``torch.load(mmap=True, weights_only=True)``; and the seed's
pre-split ``pytorch_embs.pt`` / ``pytorch_{i}.pt`` / ``pytorch_lm_head.pt`` holding HF tensor names
(a layer file may hold module-relative names; tied embeddings may be stored in both end files), which
:func:`split_checkpoint` writes from any other. The stage is built on the meta device and filled key by
key with a shape check: a missing, mis-shaped or unreadable tensor is a :class:`CheckpointError` naming
the file and tensor, never a silent random init. ``TensorStore.loaded`` / ``opened_files`` record what
a stage read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from tasks.files import atomic_path

from pipeline.models.families import DecoderSpec, Source, cat0, family_for, parameter_sources
from pipeline.models.backends import choose_backend
from pipeline.models.decoder import StageModel
from pipeline.models.hf_stage import HFStageModel, UnsupportedModel, hf_config
from pipeline.models.kernels.int8 import quantize_linears
from pipeline.models.kernels.invariant import ROW_TILE
from pipeline.loading.tensor_store import EMBS, HEAD, CheckpointError, Part, TensorStore
from pipeline.loading.quantized import checkpoint_format, load_projections, quantize_projections
from pipeline.loading.parallel_read import ParallelReader
from pipeline.loading.upload import Uploader

log = logging.getLogger(__name__)


_AS_IS = Source([]).combine  # the default combine: the one tensor unchanged
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt)$|.*\.index\.json$")


def read_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json; --model-name must be a HuggingFace model folder")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read config: {e}") from e


def embed_side(spec: DecoderSpec) -> set[str]:
    """Names of the embedding-side parameters of a StageModel (the rest of the non-layer ones are the head's)."""
    with torch.device("meta"):
        return {n for n, _ in StageModel(spec, 0, 0, True, False).named_parameters()}


def _part_of(param: str, first: int, embs: set[str]) -> Part:
    if param.startswith("layers."):
        return first + int(param.split(".")[1])
    return EMBS if param in embs else HEAD


def _refuse_on_generic(quantize: str | None, batch_invariant: bool) -> None:
    """The generic transformers stage has neither int8 layers nor fixed-shape kernels."""
    if quantize:
        raise UnsupportedModel(f"--quantize {quantize} needs the native code of a family; the generic transformers "
                               "stage does not quantize (drop --quantize)")
    if batch_invariant:
        raise UnsupportedModel("--batch-invariant needs the native code of a family; the generic transformers "
                               "stage does not have its fixed-shape kernels (drop --batch-invariant)")


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
    quantize: str | None = None,
) -> tuple[StageModel | HFStageModel, TensorStore]:
    """Build a stage and fill it from the checkpoint, touching only the tensors it owns. ``backend``:
    :mod:`pipeline.models.backends`. ``quantize="int8"``: the projections hold int8 weights, quantized
    tensor by tensor as they are read (their kernel is chosen afterwards: ``int8.choose_kernels``)."""
    cfg = read_config(model_dir)
    if choose_backend(cfg, model_type, backend) == "transformers":
        _refuse_on_generic(quantize, batch_invariant)
        return _build_hf_stage(model_dir, cfg, first, last, has_embed, has_head, dtype, device, model_type)
    family = family_for(cfg, model_type)
    spec: DecoderSpec = family.to_spec(cfg)
    fmt = checkpoint_format(cfg)  # a pre-quantized checkpoint (pipeline.loading.quantized), or None
    with _filling(model_dir, device) as (store, up, reader):
        with torch.device("meta"):
            model = StageModel(spec, first, last, has_embed, has_head, ROW_TILE if batch_invariant else 0)
            if quantize == "int8":
                quantize_linears(model)
            packed = {} if fmt is None else quantize_projections(model, family, spec, fmt, store.has)
        model = model.to(dtype).to_empty(device=device)  # cast on meta: storage only ever in the run's dtype
        model.tie()
        embs = embed_side(spec)
        params = dict(model.named_parameters())
        if packed:
            load_projections(model, packed, fmt, _packed_getter(store, device))
        for name, source in parameter_sources(family, spec, model).items():
            part = _part_of(name, first, embs)
            source = store.layout(source, part)
            param = params[name]
            if reader is not None and _fill(store, source, part, param.data, reader):
                continue
            _load_param(store, up, model, spec.family, name, source, part, param)
    model.init_buffers()
    model.eval().requires_grad_(False)
    log.info("loaded %d tensors from %d files for layers [%d, %d) embed=%s head=%s",
             len(store.loaded), len(store.opened_files), first, last, has_embed, has_head)
    return model, store


@contextlib.contextmanager
def _filling(model_dir, device) -> Iterator[tuple[TensorStore, Uploader, ParallelReader | None]]:
    """(the checkpoint, the uploader to ``device``, on a CPU the threaded reader that reads chunks straight
    into the parameters); every queued read and upload is complete on leaving, and the files closed."""
    store, up = TensorStore(model_dir), Uploader(device)
    reader = None if up.cuda else ParallelReader()
    try:
        yield store, up, reader
        if reader is not None:
            reader.wait()
        up.finish()
    finally:
        if reader is not None:
            reader.close()  # before the files close: its threads read them
        store.close()


def _load_param(store: TensorStore, up: Uploader, model: torch.nn.Module, family: str, name: str, source: Source,
                part: Part, param: torch.nn.Parameter) -> None:
    """Fill one parameter the threaded reader does not take (GPU stages, int8 weights, other formats):
    read (straight into the target when stored as is), combine, check the shape, put or quantize."""
    if param.dtype == torch.int8 and source.combine in (_AS_IS, cat0):
        return _quantize_param(store, model, family, name, source, part, param)
    if len(source.names) == 1 and source.combine is _AS_IS:
        with torch.no_grad():  # the common case: no temporary when the stored dtype is the stage's
            target = up.target(param.data)
            tensors = [store.get(source.names[0], part, out=target)]
            if tensors[0] is None:
                up.commit(param.data, target)
                return
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
            f"but {name} of this {family} config needs {tuple(param.shape)}"
        )
    with torch.no_grad():
        if param.dtype == torch.int8:  # an Int8Linear's weight: quantized from the float tensor
            model.get_submodule(name.rsplit(".", 1)[0]).load_float(value)
        else:
            up.put(param.data, value)  # casts to the stage dtype without another temporary


def _quantize_param(store: TensorStore, model: torch.nn.Module, family: str, name: str, source: Source, part: Part,
                    param: torch.nn.Parameter) -> None:
    """An Int8Linear's weight from its stored float tensor(s), one stored tensor at a time, each quantized
    into its own rows a block at a time (per-row scales: the same bits as quantizing the fused weight
    whole), so loading holds one stored tensor, never the fused float weight nor its float32 copies."""
    module = model.get_submodule(name.rsplit(".", 1)[0])
    row, shapes = 0, []
    for n in source.names:
        tensor = store.get(n, part)
        shapes.append(tuple(tensor.shape))
        if tensor.dim() != 2 or tensor.shape[1] != param.shape[1] or row + tensor.shape[0] > param.shape[0]:
            break
        module.load_float(tensor, row)
        row += tensor.shape[0]
        del tensor
    if row != param.shape[0] or len(shapes) != len(source.names):
        files = ", ".join(sorted({str(store.file_of[n]) for n in source.names if n in store.file_of}))
        raise CheckpointError(f"{files}: tensor {'+'.join(source.names)} has shape "
                              f"{' + '.join(map(str, shapes))}, but {name} of this {family} config needs "
                              f"{tuple(param.shape)}")


def _fill(store: TensorStore, source: Source, part: Part, param: torch.Tensor, reader: ParallelReader) -> bool:
    """Queue ``source``'s tensors to be read straight into ``param`` (a CPU parameter): one stored
    tensor as is, or several concatenated along dim 0 (fused q/k/v, gate/up), each into its rows.
    False when that cannot be done (another layout or combine, int8, shapes that do not add up):
    the caller reads and combines them, and names any mismatch."""
    if param.dtype == torch.int8 or not param.is_contiguous():
        return False
    if source.combine is _AS_IS and len(source.names) == 1:
        return store.fill(source.names[0], part, param, reader)
    if source.combine is not cat0 or param.dim() == 0:
        return False
    shapes = [store.stored_shape(n, part) for n in source.names]
    if any(s is None or s[1:] != list(param.shape[1:]) for s in shapes) or sum(s[0] for s in shapes) != param.shape[0]:
        return False
    row = 0
    for n, s in zip(source.names, shapes):  # a row block of a contiguous tensor is contiguous
        if not store.fill(n, part, param.narrow(0, row, s[0]), reader):
            raise CheckpointError(f"{store.listing}: tensor {n!r} changed while loading")  # stored_shape said yes
        row += s[0]
    return True


def _packed_getter(store: TensorStore, device):
    """``get(layer, name, optional=False)``: a packed checkpoint tensor of a decoder layer, on ``device``."""
    def get(part: int, name: str, optional: bool = False):
        if optional and not store.has(name, part):
            return None
        return store.get(name, part).to(device)

    return get


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
    model = HFStageModel(hf_config(cfg, model_type), first, last, has_embed, has_head)
    model = model.materialize(device, dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(model.named_buffers())
    with _filling(model_dir, device) as (store, up, reader):
        for name, (candidates, kind) in model.checkpoint_names().items():
            param = params[name]
            part = {"embs": EMBS, "head": HEAD}.get(kind) or first + int(name.split(".")[1])
            present = next((c for c in candidates if store.has(c, part)), None)
            if reader is not None and present and store.fill(present, part, param.data, reader):
                continue
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


__all__ = ["CheckpointError", "TensorStore", "build_stage", "read_config", "split_checkpoint"]
