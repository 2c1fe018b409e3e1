"""FP8 projections of compressed-tensors ``float-quantized`` checkpoints: :class:`FP8Linear`.

The weight is float8_e4m3fn ``q`` (out, in) with float32 scales per tensor, row or block: ``W = q * s``.
Activations the checkpoint quantizes are quantized to e4m3 before the product (per token, group or
tensor with ``scale = max |x| / 448``, or the static ``input_scale``). Kernels: ``dequantize`` (any
device; activations quantized and dequantized again, then ``F.linear``) and, on CUDA where it runs and
agrees on a probe, ``scaled_mm`` (``torch._scaled_mm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.kernels.int8 import Float32Buffers

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


class FP8Linear(Float32Buffers):
    """``weight_scale`` shape by ``strategy``: tensor and channel (out, 1), block (ceil(out / br),
    ceil(in / bc)). ``act``: None (weights only), ``token``, ``group`` (``act_group`` columns),
    ``tensor`` (dynamic) or ``static`` (the stored ``input_scale``)."""

    float32_buffers = ("weight_scale", "input_scale")

    def __init__(self, in_features: int, out_features: int, bias: bool, strategy: str,
                 block: tuple[int, int] | None = None, act: str | None = None, act_group: int = 0):
        super().__init__()
        self.in_features, self.out_features, self.strategy, self.block = in_features, out_features, strategy, block
        self.act, self.act_group = act, act_group
        if act == "group" and (act_group <= 0 or in_features % act_group):
            raise ValueError(f"activation groups of {act_group} columns do not divide the {in_features} inputs")
        # per-tensor scales are kept per row: fused projections (q, k, v) each bring their own
        shape = (-(-out_features // block[0]), -(-in_features // block[1])) if strategy == "block" else (out_features, 1)
        self.strategy = "block" if strategy == "block" else "channel"
        # the fp8 bytes as uint8: module.to(dtype) casts every floating tensor, float8 included
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.empty(shape, dtype=torch.float32))
        self.register_buffer("input_scale", torch.empty(1 if act == "static" else 0, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel = "dequantize"

    def fp8(self) -> torch.Tensor:
        return self.weight.view(torch.float8_e4m3fn)

    @torch.no_grad()
    def load(self, weight: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None = None) -> None:
        """Fill from the checkpoint's (out, in) float8_e4m3fn weight and its scales (shapes checked)."""
        if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight {weight.dtype} {tuple(weight.shape)}: needs float8_e4m3fn "
                             f"{(self.out_features, self.in_features)}")
        scale = scale.float().reshape(-1, 1) if self.strategy == "channel" else scale.float()
        if scale.shape[0] == 1 and self.strategy == "channel":
            scale = scale.expand(self.out_features, 1)
        if tuple(scale.shape) != tuple(self.weight_scale.shape):
            raise ValueError(f"weight_scale {tuple(scale.shape)}: needs {tuple(self.weight_scale.shape)}")
        self.weight.copy_(weight.view(torch.uint8))
        self.weight_scale.copy_(scale)
        if self.act == "static":
            self.input_scale.copy_(input_scale.float().reshape(-1)[:1])

    def scales_full(self) -> torch.Tensor:
        """(out, in) or broadcastable float32 scale of every weight element."""
        s = self.weight_scale
        if self.strategy != "block":
            return s
        br, bc = self.block
        return s.repeat_interleave(br, 0)[: self.out_features].repeat_interleave(bc, 1)[:, : self.in_features]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.fp8().float() * self.scales_full()).to(dtype)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, in) -> fp8 values and float32 scales broadcastable to (rows, in)."""
        xf = x.float()
        if self.act == "static":
            scale = self.input_scale.reshape(1, 1)
        elif self.act == "token":
            scale = xf.abs().amax(1, keepdim=True) / FP8_MAX
        elif self.act == "group":
            g = xf.unflatten(1, (-1, self.act_group)).abs().amax(-1)  # (rows, groups)
            scale = (g / FP8_MAX).repeat_interleave(self.act_group, 1)
        else:  # dynamic per tensor
            scale = (xf.abs().amax() / FP8_MAX).reshape(1, 1)
        scale = scale.clamp(min=torch.finfo(torch.float32).eps)
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale

    def set_kernel(self, kernel: str) -> None:
        if kernel == "scaled_mm" and not (self.weight.is_cuda and self.act in ("token", "tensor", "static")
                                          and self.strategy in ("tensor", "channel")):
            raise RuntimeError("torch._scaled_mm needs CUDA, per-token or per-tensor activations and per-tensor "
                               "or per-channel weight scales")
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (m, in)
        if self.kernel == "scaled_mm":
            xq, sx = self.quantize_input(flat)
            sw = self.weight_scale.expand(self.out_features, 1).t().contiguous()  # (1, out)
            y = torch._scaled_mm(xq, self.fp8().t(), scale_a=sx.expand(xq.shape[0], 1).contiguous(), scale_b=sw,
                                 out_dtype=x.dtype)
        else:
            if self.act is not None:  # what the checkpoint was calibrated with: the activations' fp8 rounding
                xq, sx = self.quantize_input(flat)
                flat = (xq.float() * sx).to(x.dtype)
            y = F.linear(flat, self.dequantized(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, scales={self.strategy}"
                f"{self.block or ''}, activations={self.act}, kernel={self.kernel}")


def cat_fp8(parts: list[tuple[torch.Tensor, torch.Tensor]], out_rows: list[int], block: tuple[int, int] | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scale) of fused projections (q, k, v) stacked along the output rows; a per-tensor
    scale becomes one per row of its part. Blocks must not straddle two parts (ValueError)."""
    if block is None:
        scales = [s.float().reshape(-1, 1).expand(n, 1) if s.numel() == 1 else s.float().reshape(-1, 1)
                  for (_, s), n in zip(parts, out_rows)]
    else:
        if any(n % block[0] for n in out_rows[:-1]):
            raise ValueError(f"fused projections whose rows are not whole blocks of {block[0]}")
        scales = [s for _, s in parts]
    return torch.cat([w for w, _ in parts]), torch.cat(scales)


@torch.inference_mode()
def choose_kernels(model: nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """On CUDA, ``scaled_mm`` for every :class:`FP8Linear` where it runs and agrees with
    ``dequantize`` on a probe (within fp8's rounding), else ``dequantize``; {"INxOUT": kernel}."""
    chosen = {}
    for m in model.modules():
        if not isinstance(m, FP8Linear):
            continue
        key = f"{m.in_features}x{m.out_features}"
        if m.weight.is_cuda and chosen.get(key, "scaled_mm") == "scaled_mm":
            try:
                x = torch.randn(32, m.in_features, device=m.weight.device, dtype=dtype)
                m.set_kernel("dequantize")
                ref = m(x).float()
                m.set_kernel("scaled_mm")
                if not torch.allclose(m(x).float(), ref, rtol=0.1, atol=0.1 * float(ref.abs().max())):
                    raise RuntimeError("torch._scaled_mm disagrees with dequantize")
            except (RuntimeError, NotImplementedError):
                m.set_kernel("dequantize")
        chosen[key] = m.kernel
    return chosen
