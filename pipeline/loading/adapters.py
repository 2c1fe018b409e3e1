"""PEFT LoRA adapter folders: read, check against the model, and slice per stage (without peft).

A module's factors ``lora_A`` (r, in) and ``lora_B`` (out, r) add ``scaling * B @ A @ x`` to its
output (``scaling = lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``). Our projections fuse
several HF modules in the family's own row layouts, so the factors reuse the family's
:class:`~pipeline.models.families.Source`: the fused ``A`` stacks each module's ``A`` (ranks side by
side) and the fused ``B`` is ``combine`` of each module's ``B`` in its own rank columns (zeros where the
adapter skips a module); ``B_fused @ A_fused`` is then exactly ``combine`` of the per-module updates.

:func:`read_adapter` (from the plan, before loading) reads only the config and tensor names and refuses
what it cannot run; :func:`stage_adapters` reads just one stage's layers' tensors.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.loading.tensor_store import SafetensorsFile
from pipeline.models.families import DecoderSpec, family_for
from pipeline.models.lora import MODULES, StageAdapters

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_TRANSPOSED = {"gpt2"}  # HF Conv1D: weights stored (in, out); PEFT's factors are still A (r, in), B (out, r)


class AdapterError(ValueError):
    """An adapter this runner cannot apply (reported before loading, exit 2)."""


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    alpha: float
    rslora: bool
    weights: Path  # adapter_model.safetensors or .bin
    modules: dict[str, dict[str, str]]  # HF module path -> {"A": key, "B": key}
    shapes: dict[str, tuple[int, ...]]  # tensor key -> shape (from the header: nothing loaded)

    def scaling(self, r: int) -> float:
        return self.alpha / math.sqrt(r) if self.rslora else self.alpha / r


def read_adapter(name: str, path: str | Path) -> Adapter:
    """The adapter's config and tensor names (the tensors themselves stay on disk)."""
    folder = Path(path)
    cfg_path = folder / "adapter_config.json"
    if not cfg_path.is_file():
        raise AdapterError(f"--lora {name}={path}: no adapter_config.json there (expected a PEFT adapter folder, "
                           "as save_pretrained writes it)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise AdapterError(f"{cfg_path}: not valid JSON: {e}") from None
    _check_config(name, cfg)
    weights = next((folder / f for f in ("adapter_model.safetensors", "adapter_model.bin")
                    if (folder / f).is_file()), None)
    if weights is None:
        raise AdapterError(f"--lora {name}={path}: no adapter_model.safetensors or adapter_model.bin")
    shapes = _tensor_shapes(weights)
    modules: dict[str, dict[str, str]] = {}
    for key in shapes:
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B factor of a linear layer "
                               "(embedding adapters, trained biases and DoRA magnitudes are not supported)")
        modules.setdefault(m["module"], {})[m["ab"]] = key
    for module, ab in modules.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: {module} has lora_{''.join(ab)} but not both factors")
        (r, _), (_, r_b) = shapes[ab["A"]], shapes[ab["B"]]
        if r != r_b:
            raise AdapterError(f"adapter {name!r}: {module} has rank {r} in lora_A but {r_b} in lora_B")
    alpha = float(cfg.get("lora_alpha") or cfg.get("r") or 8)
    return Adapter(name, folder, alpha, bool(cfg.get("use_rslora")), weights, modules, shapes)


def _check_config(name: str, cfg: dict) -> None:
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {cfg.get('peft_type')!r} (only LORA adapters are supported)")
    if cfg.get("use_dora"):
        problems.append("use_dora (DoRA adapters are not supported)")
    if cfg.get("modules_to_save"):
        problems.append(f"modules_to_save {cfg['modules_to_save']} (fully trained modules replace base weights: "
                        "merge that adapter into a model folder instead)")
    if cfg.get("alpha_pattern"):
        problems.append("alpha_pattern (per-module alphas are not supported)")
    if cfg.get("lora_bias") or cfg.get("bias", "none") != "none":
        problems.append("trained biases (bias / lora_bias)")
    if cfg.get("target_parameters"):
        problems.append("target_parameters (LoRA on raw parameters such as MoE experts is not supported)")
    if problems:
        raise AdapterError(f"adapter {name!r} uses {'; '.join(problems)}")


def _tensor_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    """Tensor key -> shape, from the safetensors header (or a memory-mapped .bin): no tensor is read."""
    try:
        if weights.suffix == ".safetensors":
            f = SafetensorsFile(weights)
            f.close()
            return {k: tuple(e["shape"]) for k, e in f.entries.items()}
        sd = torch.load(weights, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: say which
        raise AdapterError(f"{weights}: cannot read the adapter's tensors: {e}") from None
    return {k: tuple(v.shape) for k, v in sd.items()}


def _targets(spec: DecoderSpec, layer: int) -> list[str]:
    """Our projections of a layer that adapters may target (a mixture-of-experts layer: attention only)."""
    dense_mlp = spec.moe is None or not spec.moe.sparse(layer)
    return [m for m in MODULES if dense_mlp or not m.startswith("mlp.")]


def module_map(cfg: dict, spec: DecoderSpec, model_type: str | None = None) -> dict[str, tuple[int, str, int, int]]:
    """HF module path -> (global layer, our projection, position among the projection's HF tensors, their count)."""
    family = family_for(cfg, model_type)
    out = {}
    for i in range(spec.num_layers):
        for module in _targets(spec, i):
            names = family.layer_source(spec, i, module + ".weight").names
            for j, name in enumerate(names):
                out[name.removesuffix(".weight")] = (i, module, j, len(names))
    return out


def check_adapter(adapter: Adapter, cfg: dict, spec: DecoderSpec, model_type: str | None = None) -> None:
    """Every module the adapter targets is a projection of this model, with the right widths."""
    where = module_map(cfg, spec, model_type)
    unknown = sorted(m for m in adapter.modules if m not in where)
    if unknown:
        known = sorted({p.rsplit(".", 1)[-1] for p in where})
        raise AdapterError(f"adapter {adapter.name!r} targets {unknown[0]}"
                           f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}, which this "
                           f"{spec.family} model cannot take an adapter on; supported target modules: "
                           f"{', '.join(known)}")
    for module, ab in adapter.modules.items():
        _, ours, j, parts = where[module]
        want_in, want_out = _in_width(spec, ours), _out_widths(spec, ours, parts)[j]
        got_in, got_out = adapter.shapes[ab["A"]][1], adapter.shapes[ab["B"]][0]
        if (got_in, got_out) != (want_in, want_out):
            raise AdapterError(f"adapter {adapter.name!r}: {module} maps {got_in} -> {got_out} features, but this "
                               f"model's maps {want_in} -> {want_out}: the adapter was trained on another model")


def _in_width(spec: DecoderSpec, module: str) -> int:
    return {"attn.qkv": spec.hidden_size, "attn.o": spec.q_dim, "mlp.up": spec.hidden_size,
            "mlp.down": spec.intermediate_size}[module]


def _out_widths(spec: DecoderSpec, module: str, parts: int) -> list[int]:
    """Output rows of each HF tensor that makes our projection (fused ones: all of it)."""
    if module == "attn.qkv" and parts == 3:
        return [spec.q_dim, spec.kv_dim, spec.kv_dim]
    if module == "mlp.up" and parts == 2:
        return [spec.intermediate_size] * 2
    total = {"attn.qkv": spec.q_dim + 2 * spec.kv_dim, "attn.o": spec.hidden_size,
             "mlp.up": spec.intermediate_size * (2 if spec.mlp == "gated" else 1), "mlp.down": spec.hidden_size}
    return [total[module]]


def stage_adapters(adapters: list[Adapter], cfg: dict, spec: DecoderSpec, first: int, last: int,
                   dtype: torch.dtype, device, model_type: str | None = None) -> tuple[StageAdapters, list[str]]:
    """The fused factors of layers [first, last) for every adapter; also the tensor keys read."""
    family = family_for(cfg, model_type)
    factors: dict[tuple[int, str], list] = {}
    read: list[str] = []
    for k, adapter in enumerate(adapters):
        tensors = _Reader(adapter.weights)
        try:
            for i in range(first, last):
                for module in _targets(spec, i):
                    source = family.layer_source(spec, i, module + ".weight")
                    f = _fuse(adapter, spec, module, source, tensors, read)
                    if f is not None:
                        slot = factors.setdefault((i - first, module), [None] * len(adapters))
                        slot[k] = (f[0].to(device, dtype).contiguous(), f[1].to(device, dtype).contiguous())
        finally:
            tensors.close()
    return StageAdapters([a.name for a in adapters], factors), read


def _fuse(adapter: Adapter, spec: DecoderSpec, module: str, source, tensors, read: list[str]):
    """(A (r_total, in), scaled B (out, r_total)) of our projection, or None if the adapter skips it."""
    names = [n.removesuffix(".weight") for n in source.names]
    parts = [adapter.modules.get(n) for n in names]
    if not any(parts):
        return None
    widths = _out_widths(spec, module, len(names))
    factors = []
    for ab in parts:
        if ab is None:
            factors.append(None)
            continue
        a, b = tensors.get(ab["A"]).float(), tensors.get(ab["B"]).float()
        read += [ab["A"], ab["B"]]
        factors.append((a, b * adapter.scaling(a.shape[0])))
    ranks = [f[0].shape[0] if f else 0 for f in factors]
    total = sum(ranks)
    a_fused = torch.cat([f[0] for f in factors if f])
    blocks, col = [], 0
    for f, width, r in zip(factors, widths, ranks):
        block = torch.zeros(width, total)
        if f:
            block[:, col : col + r] = f[1]
        col += r
        blocks.append(block.t() if spec.family in _TRANSPOSED else block)  # in the checkpoint's layout
    b_fused = source.combine(blocks)
    assert tuple(b_fused.shape) == (sum(widths), total), (module, b_fused.shape)
    return a_fused, b_fused


class _Reader:
    """One adapter file's tensors by key (safetensors: read on demand; .bin: memory-mapped)."""

    def __init__(self, path: Path):
        self.st = SafetensorsFile(path) if path.suffix == ".safetensors" else None
        self.sd = None if self.st else torch.load(path, map_location="cpu", mmap=True, weights_only=True)

    def get(self, key: str) -> torch.Tensor:
        return self.st[key] if self.st else self.sd[key]

    def close(self) -> None:
        if self.st:
            self.st.close()


def layer_bytes(adapters: list[Adapter], cfg: dict, spec: DecoderSpec, dtype_size: int,
                model_type: str | None = None) -> list[int]:
    """Bytes every adapter's factors take on each layer in the run's dtype (for stage sizing)."""
    where = module_map(cfg, spec, model_type)
    out = [0] * spec.num_layers
    for adapter in adapters:
        for module, ab in adapter.modules.items():
            layer = where[module][0]
            r, n_in = adapter.shapes[ab["A"]]
            fused_out = sum(_out_widths(spec, where[module][1], 1))
            out[layer] += r * (n_in + fused_out) * dtype_size
    return out
