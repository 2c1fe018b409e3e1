"""compressed-tensors checkpoints (llm-compressor; ``quant_method: compressed-tensors``):
``pack-quantized`` int4 / int8 weights and ``float-quantized`` FP8 weights (+ FP8 activations).

``pack-quantized`` (per linear ``X``): ``X.weight_packed`` int32 (out, in * bits / 32): each signed
value ``v`` stored as ``v + 2^(bits-1)``, ``32 / bits`` per word along the input dimension, value k
of a word in bits ``k * bits ..``; ``X.weight_scale`` (out, groups) (``channel``: one group);
asymmetric: ``X.weight_zero_point`` int32 packed the same way along the output dimension (signed,
offset like the values); act order: ``X.weight_g_idx`` (in,). ``W = (v - zp) * scale`` per group;
symmetric: ``zp = 0``. ``float-quantized``: ``X.weight`` float8_e4m3fn (out, in), ``X.weight_scale``
per tensor (1), channel (out, 1) or block (ceil(out / br), ceil(in / bc)), ``W = weight * scale``;
activations as ``input_activations`` says (dynamic per token / group / tensor, or static:
``X.input_scale``). Written from compressed-tensors' ``pack_to_int32`` / ``PackedQuantizationCompressor``
/ ``FloatQuantizationCompressor`` and its ``QuantizationArgs``.

Anything else (other bit widths, int activations, NVFP4/MXFP4, sparsity, transforms, a quantized KV
cache, a checkpoint saved uncompressed) is refused by name.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pipeline.loading.quantized.common import QuantFormat, UnsupportedQuantization, unpack_int32
from pipeline.models.kernels.fp8 import FP8Linear, cat_fp8
from pipeline.models.kernels.weight_only import IntWeight, QuantLinear

_TOP = {"quant_method", "format", "config_groups", "ignore", "kv_cache_scheme", "quantization_status",
        "sparsity_config", "transform_config", "global_compression_ratio", "version", "quant_config_type"}
_ARGS = {"num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic", "actorder",
         "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}
_FORMATS = ("pack-quantized", "float-quantized")


def _check_args(args: dict, where: str) -> None:
    unknown = sorted(k for k, v in args.items() if k not in _ARGS and v not in (None, False, {}, []))
    if unknown:
        raise UnsupportedQuantization(f"compressed-tensors {where} settings this runner does not know: {unknown}")


class Group:
    """One entry of ``config_groups``: its targets and how its weights / activations are stored."""

    def __init__(self, name: str, g: dict, default_format: str | None):
        self.name, self.targets = name, list(g.get("targets") or [])
        self.format = g.get("format") or default_format
        w, a = g.get("weights"), g.get("input_activations")
        if g.get("output_activations"):
            raise UnsupportedQuantization(f"compressed-tensors group {name}: quantized output activations")
        if not w:
            raise UnsupportedQuantization(f"compressed-tensors group {name}: no weight quantization")
        _check_args(w, f"group {name} weights")
        if self.format not in _FORMATS:
            raise UnsupportedQuantization(f"compressed-tensors format {self.format!r} (supported: {', '.join(_FORMATS)})")
        self.bits, self.kind, self.strategy = int(w.get("num_bits", 8)), w.get("type", "int"), w.get("strategy")
        self.symmetric, self.group_size = bool(w.get("symmetric", True)), int(w.get("group_size") or 0)
        self.actorder = w.get("actorder")
        if w.get("dynamic"):
            raise UnsupportedQuantization(f"compressed-tensors group {name}: dynamic weight quantization")
        if self.format == "pack-quantized":
            if self.kind != "int" or self.bits not in (4, 8) or self.strategy not in ("group", "channel"):
                raise UnsupportedQuantization(f"compressed-tensors pack-quantized {self.kind}{self.bits} with strategy "
                                              f"{self.strategy!r} (supported: int4 / int8, group or channel)")
            if a:
                raise UnsupportedQuantization(f"compressed-tensors group {name}: pack-quantized with quantized "
                                              "input activations (supported: weight-only)")
            if self.actorder not in (None, "group", "weight", "static"):
                raise UnsupportedQuantization(f"compressed-tensors actorder {self.actorder!r}")
        else:
            if self.kind != "float" or self.bits != 8 or self.strategy not in ("tensor", "channel", "block"):
                raise UnsupportedQuantization(f"compressed-tensors float-quantized {self.kind}{self.bits} with strategy "
                                              f"{self.strategy!r} (supported: fp8, tensor / channel / block)")
            self.block = tuple(w["block_structure"]) if self.strategy == "block" else None
            self.act, self.act_group = _activations(name, a)

    def matches(self, base: str) -> bool:
        return any(_target_matches(t, base) for t in self.targets)


def _activations(name: str, a: dict | None) -> tuple[str | None, int]:
    if not a:
        return None, 0
    _check_args(a, f"group {name} input_activations")
    if a.get("type", "float") != "float" or int(a.get("num_bits", 8)) != 8 or not a.get("symmetric", True):
        raise UnsupportedQuantization(f"compressed-tensors group {name}: input activations {a.get('type')}"
                                      f"{a.get('num_bits')} (supported: symmetric fp8)")
    strategy, dynamic = a.get("strategy"), a.get("dynamic")
    if dynamic is True and strategy in ("token", "tensor", "group"):
        return strategy, int(a.get("group_size") or 0)
    if dynamic is False and strategy == "tensor":
        return "static", 0
    raise UnsupportedQuantization(f"compressed-tensors group {name}: input activations strategy {strategy!r} "
                                  f"dynamic={dynamic!r} (supported: dynamic token / tensor / group, static tensor)")


def _target_matches(target: str, base: str) -> bool:
    """A compressed-tensors target or ignore entry: a class name (``Linear``: every projection here),
    ``re:<regex>`` on the module name, or the module name itself."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], base) is not None
    return target == base


class CompressedTensors(QuantFormat):
    def __init__(self, qc: dict):
        unknown = sorted(k for k, v in qc.items() if k not in _TOP and v not in (None, {}, []))
        if unknown:
            raise UnsupportedQuantization(f"compressed-tensors quantization_config keys this runner does not know: {unknown}")
        if qc.get("kv_cache_scheme"):
            raise UnsupportedQuantization("compressed-tensors kv_cache_scheme (a quantized KV cache)")
        if qc.get("sparsity_config") and qc["sparsity_config"].get("format", "dense") != "dense":
            raise UnsupportedQuantization(f"compressed-tensors sparsity format {qc['sparsity_config'].get('format')!r}")
        if qc.get("transform_config"):
            raise UnsupportedQuantization("compressed-tensors transform_config (rotations)")
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise UnsupportedQuantization(f"compressed-tensors quantization_status {status!r} (supported: compressed)")
        groups = qc.get("config_groups") or {}
        if not groups:
            raise UnsupportedQuantization("compressed-tensors without config_groups")
        self.groups = [Group(n, g, qc.get("format")) for n, g in groups.items()]
        self.ignore = list(qc.get("ignore") or [])
        first = self.groups[0]
        kinds = sorted({f"int{g.bits}" if g.kind == "int" else "fp8" for g in self.groups})
        self.name = "ct-" + "+".join(kinds)
        self.bits, self.group_size = first.bits, first.group_size

    def group_of(self, base: str) -> Group | None:
        if any(_target_matches(t, base) for t in self.ignore):
            return None
        return next((g for g in self.groups if g.matches(base)), None)

    def packed_names(self, base: str) -> list[str]:
        g = self.group_of(base)
        if g is None:
            return [f"{base}.weight_packed"]  # never present unless the ignore list is wrong: then a clear error
        return [f"{base}.weight_packed", f"{base}.weight_scale"] if g.format == "pack-quantized" else \
            [f"{base}.weight", f"{base}.weight_scale"]

    def module(self, base: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        g = self.group_of(base)
        if g.format == "float-quantized":
            return FP8Linear(in_features, out_features, bias, g.strategy, g.block, g.act, g.act_group)
        return QuantLinear(in_features, out_features, bias, g.bits, in_features if g.strategy == "channel" else g.group_size)

    def read(self, get, base: str, in_features: int, out_features: int) -> IntWeight:
        g = self.group_of(base)
        offset = 1 << (g.bits - 1)
        codes = unpack_int32(get(f"{base}.weight_packed"), g.bits, dim=1)[:, :in_features]  # (out, in) v + offset
        scales = get(f"{base}.weight_scale").float().reshape(out_features, -1)
        if g.symmetric:
            zeros = torch.full_like(scales, float(offset))
        else:
            zp = get(f"{base}.weight_zero_point")
            zeros = unpack_int32(zp.t(), g.bits, dim=1).t()[:out_features].float() if zp.dtype == torch.int32 \
                else zp.float().reshape(out_features, -1) + offset  # packed int32, or plain int8 values
        g_idx = get(f"{base}.weight_g_idx", optional=True) if g.actorder in ("group", "weight") else None
        group = in_features if g.strategy == "channel" else g.group_size
        if g_idx is not None and (g_idx < 0).any():
            g_idx = None  # compressed-tensors stores -1s when the order is the trivial one
        return IntWeight(codes.to(torch.uint8).contiguous(), scales.contiguous(), zeros.contiguous(), g.bits, group,
                         None if g_idx is None else g_idx.to(torch.int32))

    def fill(self, module: nn.Module, get, bases: list[str], rows: list[int]) -> None:
        if not isinstance(module, FP8Linear):
            return super().fill(module, get, bases, rows)
        parts = [(get(f"{b}.weight"), get(f"{b}.weight_scale")) for b in bases]
        weight, scale = cat_fp8(parts, rows, module.block)
        input_scale = None
        if module.act == "static":  # one scale for the fused input: the largest (what vLLM does too)
            input_scale = torch.stack([get(f"{b}.input_scale").float().reshape(-1)[0] for b in bases]).max()
        module.load(weight, scale, input_scale)
