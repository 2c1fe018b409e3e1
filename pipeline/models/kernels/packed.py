"""The faster CPU products of a stage's linear layers (``--cpu-linear onednn``): weights reordered once into
oneDNN's blocked layout (:class:`PackedLinear`; float32, and bfloat16 on CPUs with bf16 instructions),
or bfloat16 on CPUs without them through the project's AVX2 loop (:class:`NativeBf16Linear`). The packed
copy replaces the weight; results are within float rounding of ``F.linear``. :func:`why_not` says when a
stage keeps ``F.linear``. Measurements: docs/design/attention-and-cpu-kernels.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from pipeline.models.decoder import projections
from pipeline.models.decoder import StageModel
from pipeline.models.kernels import native

DECODE_ROWS_HINT = 32  # oneDNN picks its blocking for this many rows; measured: any of 4..256 does as well


class PackedLinear(nn.Module):
    """``nn.Linear`` whose weight is oneDNN's prepacked copy (``weight`` is that opaque tensor: its
    ``device`` and ``dtype`` are the original's, it is not a parameter and holds no gradient)."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), DECODE_ROWS_HINT)
        self.bias = lin.bias

    prepacked = True  # what the head asks (the decoder cannot import this module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, onednn"


class NativeBf16Linear(nn.Module):
    """``nn.Linear`` in bfloat16 on a CPU without bf16 instructions (where PyTorch's bf16 product collapses
    beyond one row): from two rows on, :func:`.native.bf16_products` on the weight as it is, summed in
    float32, the bias added before the one rounding to bfloat16; one row keeps ``F.linear``."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight, self.bias = lin.weight, lin.bias

    prepacked = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] == 1:
            return F.linear(x, self.weight, self.bias)
        y = native.bf16_products(flat, self.weight)
        if self.bias is not None:
            y += self.bias
        return y.to(torch.bfloat16).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, native bf16"


def kernel_for(dtype: torch.dtype) -> str:
    """Which faster product a CPU stage in ``dtype`` takes: "native" (:class:`NativeBf16Linear`) for
    bfloat16 on a CPU without bf16 instructions, else "onednn" (:class:`PackedLinear`)."""
    return "native" if dtype == torch.bfloat16 and not native_bf16() else "onednn"


def why_not(device: torch.device, dtype: torch.dtype, batch_invariant: bool, quantize: str) -> str | None:
    """Why this stage keeps ``F.linear`` under ``--cpu-linear onednn``, or None when it takes the faster
    product (:func:`kernel_for`)."""
    if device.type != "cpu":
        return "not a CPU stage (cuBLAS on the GPU)"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"compute dtype {str(dtype).removeprefix('torch.')} (packing is for float32 and bfloat16)"
    if quantize != "none":
        return f"--quantize {quantize} has its own kernels"
    if batch_invariant:
        return "--batch-invariant keeps one kernel"
    if kernel_for(dtype) == "native":
        return None if native.bf16_loop() else (
            "compute dtype bfloat16 on a CPU without avx512_bf16 or AMX, and no C loop for it (AVX2 and a C compiler)")
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    try:
        gen = torch.Generator().manual_seed(0)  # not the global RNG: loading a stage must not move it
        w, x = torch.randn(8, 16, generator=gen).to(dtype), torch.randn(3, 16, generator=gen).to(dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 4), None, "none", [], "")
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        if not torch.allclose(y.float(), (x @ w.t()).float(), atol=tol, rtol=tol):
            return "oneDNN's packed product disagrees with F.linear on a probe"
    except (RuntimeError, AttributeError) as e:
        return f"oneDNN's packed linear is unavailable ({str(e).splitlines()[0]})"
    return None


def native_bf16() -> bool:
    """Whether this CPU has bf16 instructions (avx512_bf16 or AMX tiles) for oneDNN to use, and
    PyTorch's kernels are not held below AVX-512 (``ATEN_CPU_CAPABILITY``, :func:`.native._march`)."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"):
        return False
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check() for check in checks if check is not None)


@torch.no_grad()
def pack_linears(model: nn.Module, release: Callable[[], object] | None = None, kind: type = PackedLinear) -> int:
    """Replace the projections of every Attention and MLP in the loaded ``model`` by ``kind``
    (:class:`PackedLinear` or :class:`NativeBf16Linear`); returns how many. ``release``: called after each
    (the caller's way to hand the plain weight's freed memory back before the next packed copy is made)."""

    count = 0
    for module, name in projections(model):
        lin = getattr(module, name)
        if type(lin) is nn.Linear and (kind is PackedLinear or native.bf16_usable(lin.weight[:1], lin.weight)):
            setattr(module, name, kind(lin))
            del lin
            count += 1
            if release is not None:
                release()
    return count


def pack_stage(model: nn.Module, device: torch.device, dtype: torch.dtype, batch_invariant: bool = False,
               quantize: str = "none", kernel: str = "onednn",
               release: Callable[[], object] | None = None) -> tuple[int, str | None]:
    """``--cpu-linear KERNEL`` on a loaded stage: (projections packed, None), or (0, why not).
    Sets ``model.cpu_linear`` ("onednn", "native" or "plain") on a CPU stage, for the run summary."""

    if not isinstance(model, StageModel):
        return 0, "the generic transformers stage runs transformers' own layers"
    reason = "--cpu-linear plain" if kernel == "plain" else why_not(device, dtype, batch_invariant, quantize)
    if device.type == "cpu":
        model.cpu_linear = "plain" if reason else kernel_for(dtype)
    if kernel == "onednn" and own_float32_head(model) \
            and why_not(device, torch.float32, batch_invariant, "none") is None:  # oneDNN works here, in float32
        model.lm_head = PackedLinear(model.lm_head)
        if release is not None:  # the plain table's pages back before the layers' packed copies are made
            release()
    if reason:
        return 0, reason
    return pack_linears(model, release, NativeBf16Linear if kernel_for(dtype) == "native" else PackedLinear), None


HEAD_SHARE = 0.1  # the most of a stage's weights a head may be for its packed copy to be made


def own_float32_head(model: StageModel) -> bool:
    """Whether ``model`` holds a float32 head of its own (not the embedding's table), which :func:`pack_stage`
    packs like the projections. Only a head of at most ``HEAD_SHARE`` of the stage's weights: its plain and
    packed copies exist at once while it packs, and the stage's peak must stay within 1.1x its weights."""
    head, embed = model.lm_head, model.embed
    if not (type(head) is nn.Linear and head.weight.dtype == torch.float32
            and (embed is None or embed.weight.data_ptr() != head.weight.data_ptr())):
        return False
    weights = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
    return head.weight.nbytes <= HEAD_SHARE * weights
