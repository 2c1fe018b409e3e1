"""Pre-quantized checkpoints: ``quantization_config`` read (:func:`checkpoint_format`), the stage's
projections replaced by packed modules before loading (:func:`quantize_projections`) and filled from
this stage's packed tensors (:func:`load_projections`). One module per format (GPTQ, AWQ GEMM,
compressed-tensors); kernels in :mod:`pipeline.models.kernels.weight_only` and
:mod:`~pipeline.models.kernels.fp8`. Anything not understood raises :class:`UnsupportedQuantization`
naming it, before any weight is read. Imports models and loading.tensor_store; nothing of ranks or options.
"""

from __future__ import annotations

import functools

from torch import nn

from pipeline.loading.quantized.awq import AWQ
from pipeline.loading.quantized.common import QuantFormat, UnsupportedQuantization, module_bytes
from pipeline.loading.quantized.compressed import CompressedTensors
from pipeline.loading.quantized.gptq import GPTQ
from pipeline.models.decoder import projections
from pipeline.models.kernels.fp8 import FP8Linear
from pipeline.models.kernels.weight_only import QuantLinear

FORMATS = {"gptq": GPTQ, "awq": AWQ, "compressed-tensors": CompressedTensors}


def checkpoint_format(config: dict) -> QuantFormat | None:
    """The checkpoint's format from ``config["quantization_config"]`` (None: a float checkpoint)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise UnsupportedQuantization(f"quantization_config {qc!r} is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method not in FORMATS:
        raise UnsupportedQuantization(f"quantization_config quant_method {qc.get('quant_method')!r}: this runner "
                                      f"loads {', '.join(FORMATS)}")
    return FORMATS[method](qc)


def _hf_bases(family, spec, layer: int, module_name: str, attr: str) -> list[str]:
    """HF module names of the linears fused into ``module_name.attr`` (e.g. q, k, v for attn.qkv)."""
    source = family.layer_source(spec, layer, f"{module_name.split('.', 2)[2]}.{attr}.weight")
    return [n.removesuffix(".weight") for n in source.names]


def quantize_projections(model: nn.Module, family, spec, fmt: QuantFormat, has=None
                         ) -> dict[str, tuple[int, list[str]]]:
    """Replace (on the meta device) every decoder projection whose checkpoint tensors are packed by
    ``fmt``'s module of the same shape; returns {our module name: (layer, the HF linears fused into
    it)}. ``has(name, layer)``: whether the checkpoint holds a tensor (None: assume every projection
    is packed, as sizing does). A fused projection whose parts disagree (one packed, one float) is an error."""
    names = {id(m): n for n, m in model.named_modules()}
    replaced = {}
    for parent, attr in projections(model):
        lin = getattr(parent, attr)
        if not isinstance(lin, nn.Linear) or not names[id(parent)].startswith("layers."):
            continue
        layer = model.first + int(names[id(parent)].split(".")[1])
        bases = _hf_bases(family, spec, layer, names[id(parent)], attr)
        packed = [has is None or all(has(n, layer) for n in fmt.packed_names(b)) for b in bases]
        if not any(packed):
            continue  # left in float (an ignore list / modules_to_not_convert): the float loader reads it
        if not all(packed):
            raise UnsupportedQuantization(f"{', '.join(bases)}: fused by this runner but only partly quantized")
        setattr(parent, attr, fmt.module(bases[0], lin.in_features, lin.out_features, lin.bias is not None))
        replaced[f"{names[id(parent)]}.{attr}"] = (layer, bases)
    return replaced


def load_projections(model: nn.Module, replaced: dict[str, tuple[int, list[str]]], fmt: QuantFormat, get) -> None:
    """Fill every replaced projection from the packed tensors (``get(layer, name, optional=False)``)."""
    for name, (layer, bases) in replaced.items():
        module = model.get_submodule(name)
        rows = _rows(module.out_features, len(bases), model, name)
        try:
            fmt.fill(module, functools.partial(get, layer), bases, rows)
        except (ValueError, RuntimeError) as e:
            raise UnsupportedQuantization(f"{fmt.name} tensors of {', '.join(bases)}: {e}") from e


def _rows(out_features: int, parts: int, model: nn.Module, name: str) -> list[int]:
    """Output rows of each fused part: q, k, v by the spec's widths; gate / up halves."""
    if parts == 1:
        return [out_features]
    spec = model.spec
    if name.endswith("attn.qkv"):
        return [spec.q_dim, spec.kv_dim, spec.kv_dim]
    return [out_features // parts] * parts


def quantized_bytes(model: nn.Module) -> dict[str, int]:
    """{projection name: bytes} of the packed modules in ``model`` (sizing, on meta)."""
    return {n: module_bytes(m) for n, m in model.named_modules() if isinstance(m, (QuantLinear, FP8Linear))}


__all__ = ["FORMATS", "QuantFormat", "UnsupportedQuantization", "checkpoint_format", "load_projections",
           "quantize_projections", "quantized_bytes"]
