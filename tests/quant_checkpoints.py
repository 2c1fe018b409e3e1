"""Pre-quantized tiny checkpoints for tests: GPTQ and AWQ packed as their packers lay them out
(AutoGPTQ ``QuantLinear.pack``, AutoAWQ ``WQLinear_GEMM.from_linear``: written here from those
layouts since both packers need a GPU), compressed-tensors with its own library.

Each builder takes a float model folder and writes ``out`` (the quantized checkpoint) and ``ref``
(an ordinary float checkpoint holding the dequantized weights: what transformers loads as the
reference). The reference weights come from the integer values the builder chose, or from
compressed-tensors' own ``decompress``, never from the runner's readers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _linears(sd: dict) -> list[str]:
    return [k.removesuffix(".weight") for k in sd if k.endswith(".weight") and k.split(".")[-2] in PROJ]


def _load_all(model_dir: Path) -> dict:
    """Every tensor of the folder's safetensors files (one file or shards)."""
    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _copy_folder(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(f, dst / f.name)


def _int_quantize(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor | None):
    """(out, in) -> codes (out, in) 0..2^b-1, scales (out, G), zeros (out, G) ints, g (in,)."""
    out_f, in_f = w.shape
    group = in_f if group <= 0 else group
    g = torch.arange(in_f) // group if g_idx is None else g_idx.long()
    groups = in_f // group
    scales, zeros = torch.empty(out_f, groups), torch.empty(out_f, groups)
    top = (1 << bits) - 1
    for k in range(groups):
        cols = w[:, g == k]
        if sym:
            s = cols.abs().amax(1).clamp(min=1e-8) / ((top - 1) / 2)
            z = torch.full_like(s, float(1 << (bits - 1)))
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = ((hi - lo) / top).clamp(min=1e-8)
            z = torch.round(-lo / s).clamp(0, top)
        scales[:, k], zeros[:, k] = s, z
    codes = torch.clamp(torch.round(w / scales[:, g]) + zeros[:, g], 0, top)
    deq = (codes - zeros[:, g]) * scales[:, g]
    return codes.to(torch.int64), scales, zeros.to(torch.int64), deq


def _pack_rows(v: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """(R, C) ints -> (R, C * bits / 32) int32, ``32 / bits`` per word along columns (value
    ``order[k]`` of each 8 in nibble k when given: AWQ)."""
    per = 32 // bits
    v = v.to(torch.int64) & ((1 << bits) - 1)
    v = v.reshape(v.shape[0], -1, per)
    if order is not None:
        v = v[:, :, order]
    words = sum(v[:, :, k] << (bits * k) for k in range(per))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _finish(model_dir: Path, out: Path, ref: Path, packed: dict, ref_sd: dict, qc: dict) -> tuple[str, str]:
    _copy_folder(model_dir, out)
    _copy_folder(model_dir, ref)
    save_file({k: v.contiguous() for k, v in packed.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in ref_sd.items()}, str(ref / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(out), str(ref)


def gptq(model_dir, out, ref, bits: int = 4, group: int = 32, sym: bool = True, desc_act: bool = False,
         v2: bool = False, seed: int = 0) -> tuple[str, str]:
    """A GPTQ checkpoint (AutoGPTQ layout; ``v2``: zeros stored as is) and its dequantized reference."""
    model_dir = Path(model_dir)
    sd = _load_all(model_dir)
    packed, ref_sd = dict(sd), dict(sd)
    gen = torch.Generator().manual_seed(seed)
    perm_of: dict[int, torch.Tensor] = {}
    for base in _linears(sd):
        w = sd[base + ".weight"].float()
        in_f = w.shape[1]
        gsz = in_f if group <= 0 else group
        g_idx = None
        if desc_act:  # one order per input width (q, k, v share theirs, as GPTQ gives them: one Hessian)
            perm = perm_of.setdefault(in_f, torch.randperm(in_f, generator=gen))
            g_idx = torch.empty(in_f, dtype=torch.int32)
            g_idx[perm] = (torch.arange(in_f) // gsz).to(torch.int32)
        codes, scales, zeros, deq = _int_quantize(w, bits, group, sym, g_idx)
        del packed[base + ".weight"]
        packed[base + ".qweight"] = _pack_cols_in(codes, bits)
        packed[base + ".qzeros"] = _pack_rows(zeros.t() - (0 if v2 else 1), bits)
        packed[base + ".scales"] = scales.t().to(torch.float16)
        packed[base + ".g_idx"] = g_idx if g_idx is not None else (torch.arange(in_f) // gsz).to(torch.int32)
        g = torch.arange(in_f) // gsz if g_idx is None else g_idx.long()
        ref_sd[base + ".weight"] = ((codes - zeros[:, g]) * scales.half().float()[:, g]).to(w.dtype)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
          "true_sequential": True, "damp_percent": 0.01, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    return _finish(model_dir, Path(out), Path(ref), packed, ref_sd, qc)


def _pack_cols_in(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (out, in) -> GPTQ qweight (in * bits / 32, out): packed along the input dimension."""
    return _pack_rows(codes, bits).t().contiguous()  # (out, in / per) -> (in / per, out)


def awq(model_dir, out, ref, group: int = 32) -> tuple[str, str]:
    """An AWQ GEMM checkpoint (AutoAWQ layout, 4 bits, zero points) and its dequantized reference."""
    model_dir = Path(model_dir)
    sd = _load_all(model_dir)
    packed, ref_sd = dict(sd), dict(sd)
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble k holds column order[k] of its eight
    for base in _linears(sd):
        w = sd[base + ".weight"].float()
        codes, scales, zeros, _ = _int_quantize(w, 4, group, False, None)
        del packed[base + ".weight"]
        # qweight (in, out / 8): packed along the output columns
        packed[base + ".qweight"] = _pack_rows(codes.t().contiguous(), 4, order)
        packed[base + ".qzeros"] = _pack_rows(zeros.t().contiguous(), 4, order)
        packed[base + ".scales"] = scales.t().to(torch.float16)
        g = torch.arange(w.shape[1]) // group
        ref_sd[base + ".weight"] = ((codes - zeros[:, g]) * scales.half().float()[:, g]).to(w.dtype)
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
          "modules_to_not_convert": None}
    return _finish(model_dir, Path(out), Path(ref), packed, ref_sd, qc)


def compressed_tensors(model_dir, out, ref, preset: str = "W4A16", acts: dict | None = None,
                       **weights) -> tuple[str, str, dict]:
    """A compressed-tensors checkpoint quantized and packed by the library itself (``preset``: one of
    its scheme presets, ``weights`` / ``acts``: overrides of its weight / activation args, e.g.
    group_size=32), and the
    reference holding the library's own ``decompress``-ed weights. Returns (out, ref, config)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model_dir = Path(model_dir)
    sd = _load_all(model_dir)
    packed, ref_sd = dict(sd), dict(sd)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if weights:
        scheme.weights = scheme.weights.model_copy(update=weights)
    if acts:
        scheme.input_activations = scheme.input_activations.model_copy(update=acts)
    args = scheme.weights
    fmt = "float-quantized" if args.type == "float" else "pack-quantized"
    compressor = BaseCompressor.get_value_from_registry(fmt)
    for base in _linears(sd):
        w = sd[base + ".weight"].float()
        lo, hi = _ranges(w, args)
        scale, zp = calculate_qparams(lo, hi, args)
        state = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
        done = compressor.compress(state, scheme)
        ref_sd[base + ".weight"] = compressor.decompress(done, scheme)["weight"].to(w.dtype)
        del packed[base + ".weight"]
        if scheme.input_activations is not None and not scheme.input_activations.dynamic:
            done["input_scale"] = torch.tensor([0.02])  # a static activation scale, as calibration stores it
        packed.update({f"{base}.{k}": v for k, v in done.items()})
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                            ignore=["lm_head"]).model_dump(mode="json")
    out, ref = _finish(model_dir, Path(out), Path(ref), packed, ref_sd, qc)
    return out, ref, qc


def _ranges(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """min / max of ``w`` (out, in) per the scheme's strategy, shaped as compressed-tensors' observers give them."""
    if args.strategy == "group":
        v = w.unflatten(1, (-1, args.group_size))
        return v.amin(-1), v.amax(-1)
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy == "block":
        br, bc = args.block_structure
        v = w.unflatten(0, (-1, br)).unflatten(2, (-1, bc))  # (R, br, C, bc)
        return v.amin((1, 3)), v.amax((1, 3))
    return w.amin().reshape(1), w.amax().reshape(1)


def act_quant_hooks(model, qc: dict, input_scale: float = 0.02) -> None:
    """forward pre-hooks on ``model``'s decoder linears that fake-quantize their inputs as the
    checkpoint's input_activations say, with compressed-tensors' own ``fake_quantize``."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    a = QuantizationArgs(**qc["config_groups"]["group_0"]["input_activations"])

    def hook(_module, inputs):
        x = inputs[0]
        flat = x.reshape(-1, x.shape[-1]).float()
        if not a.dynamic:
            scale, zp = torch.tensor([input_scale]), torch.zeros(1)
        elif a.strategy == "token":
            scale, zp = calculate_qparams(flat.amin(1, keepdim=True), flat.amax(1, keepdim=True), a)
        elif a.strategy == "group":
            v = flat.unflatten(1, (-1, a.group_size))
            scale, zp = calculate_qparams(v.amin(-1), v.amax(-1), a)
        else:
            scale, zp = calculate_qparams(flat.amin().reshape(1), flat.amax().reshape(1), a)
        return (fake_quantize(flat, scale, zp, a).to(x.dtype).reshape(x.shape),)

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.split(".")[-1] in PROJ:
            m.register_forward_pre_hook(hook)
