"""int8 weights for a stage's linear layers (``--quantize int8``), with the matmul kernel chosen by measurement.

Each decoder-layer projection becomes an :class:`Int8Linear`: int8 weights (out, in) with one float32
scale per output channel, quantized from the checkpoint's tensor as it loads (embeddings, norms, the
head, MoE routers and routed experts stay in the compute dtype). Every kernel (``int8``:
``torch._int_mm``; ``onednn``: oneDNN's prepacked product; ``native``: the C loops; ``dequantize``: exact
float32 matmuls over ``EXACT_K`` features) computes the same per-token-quantized activations, the same
exact int32 sums and one :func:`epilogue`, so :func:`choose_kernels`'s timing changes speed, never a
result. The kernels, their speeds and the choice: docs/usage/quantization.md.
"""

from __future__ import annotations

import copy
import functools
import logging
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.kernels import native
from pipeline.models.kernels.kernel_table import KernelTable, set_per_shape
from pipeline.models.decoder import projections
from pipeline.models.decoder import MLP, Block, Norm

log = logging.getLogger(__name__)

KERNELS = ("int8", "onednn", "dequantize", "native")
QMAX = 127  # symmetric: -127..127 (-128 unused, so negation is exact)
QUANTIZE_ROWS = 256  # weight rows quantized at a time at load (per-row scales: any split gives the same bits)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> int8 (out, in) and float32 scales (out,): ``w ~= q * scale[:, None]``."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / QMAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def fake_quantize(w: torch.Tensor) -> torch.Tensor:
    """What the int8 weights stand for, in ``w``'s dtype (the plain reference: HF with these weights)."""
    q, scale = quantize_rows(w)
    return (q.float() * scale[:, None]).to(w.dtype)


class Float32Buffers(nn.Module):
    """A module whose ``float32_buffers`` (scales) stay float32 when ``module.to(dtype)`` casts its buffers."""

    float32_buffers: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name in self.float32_buffers:
            if getattr(self, name).dtype != torch.float32:
                setattr(self, name, getattr(self, name).float())
        return self


class Int8Linear(Float32Buffers):
    """``nn.Linear`` with int8 weights and per-output-channel scales; ``kernel`` picks the matmul."""

    float32_buffers = ("scale",)

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # a parameter, so the loader maps it to the checkpoint tensor like the float weight it replaces
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel = "dequantize"
        self.packed = None  # "onednn": oneDNN's prepacked weight (opaque); "native" with VNNI: native.pack_vnni's
        self.weight_sums = None  # "native" with VNNI: (out,) int32 sums of each weight row
        self.prologue = None  # what the quantizing pass computes first (fuse_prologues): "rms" or "silu_gate"
        self.norm_weight, self.norm_eps = None, 0.0  # "rms": the deferred norm's float32 weight and eps

    def set_kernel(self, kernel: str) -> None:
        """Use ``kernel`` from now on. ``onednn`` (and ``native`` with AVX512-VNNI) reorders the weight
        once into its layout and frees the plain copy (so no other kernel can be set afterwards)."""
        if self.packed is not None:
            if kernel != self.kernel:
                raise ValueError(f"this layer's int8 weight lives in the {self.kernel} kernel's packed layout only")
            return
        self._pack(kernel)
        if self.packed is not None:
            self.weight = nn.Parameter(torch.empty(0, dtype=torch.int8, device=self.weight.device), requires_grad=False)
        self.kernel = kernel

    def _pack(self, kernel: str) -> None:
        """Set ``packed`` (and ``weight_sums``) to ``kernel``'s layout of the plain weight, if it has one."""
        if kernel == "onednn":
            self.packed = onednn_prepack(self.weight)
        elif kernel == "native":
            path = native.int8_products_path(self.in_features) if self.weight.device.type == "cpu" else None
            if path is None:
                raise RuntimeError(f"no native int8 product for {self.in_features} input features here (a CPU "
                                   "with AVX2 and the C loops built)")
            if path == "vnni":
                self.weight_sums = self.weight.sum(1, dtype=torch.int32)
                self.packed = native.pack_vnni(self.weight)

    @torch.no_grad()
    def load_float(self, w: torch.Tensor, row: int = 0) -> None:
        """Quantize the checkpoint's float weight (out, in) into this module (on its device); ``row``:
        a piece of a fused weight (q of q/k/v, gate of gate/up) goes into its rows from ``row`` on.
        ``QUANTIZE_ROWS`` rows at a time, so the float temporaries stay a few MiB whatever the tensor's
        size (quantized whole, an 8B model's gate/up took ~2 GB of float32 copies at load)."""
        for a in range(0, w.shape[0], QUANTIZE_ROWS):
            q, scale = quantize_rows(w[a : a + QUANTIZE_ROWS].to(self.weight.device))
            self.weight[row + a : row + a + q.shape[0]].copy_(q)
            self.scale[row + a : row + a + q.shape[0]].copy_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (m, in)
        quantized = None
        if self.prologue is not None:  # the library is loaded (fuse_prologues): norm / activation and quantization
            quantized = native.quantize_rows_u8_fused(flat, self.prologue, self.norm_weight, self.norm_eps)
        y = product(self.kernel, flat, self, quantized)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, kernel={self.kernel}"


Quantized = tuple[torch.Tensor, torch.Tensor]  # (rows, in) uint8 values + 128, (rows, 1) float32 scales
EXACT_K = 1024  # input features whose int8 x int8 sum float32 holds exactly: 1024 x 127 x 127 < 2^24


def product(kernel: str, x: torch.Tensor, m: Int8Linear, quantized: Quantized | None = None) -> torch.Tensor:
    """(rows, in) -> (rows, out): x's per-token uint8 values (zero point 128) and scales (``quantized`` when the
    prologue computed them), ``kernel``'s exact integer sums against ``m``'s weight (:data:`SUMS`), then
    :func:`epilogue`."""
    xu, s = quantize_tokens(x, unsigned=True) if quantized is None else quantized
    return epilogue(SUMS[kernel](xu, m), s, m, x.dtype)


def epilogue(acc: torch.Tensor, s: torch.Tensor, m: Int8Linear, dtype: torch.dtype) -> torch.Tensor:
    """The one end of every kernel: ``float32(acc) * weight scale * row scale (+ bias)`` in ``dtype``, for
    acc (rows, out) the exact integer sums, already as float32 (``float32(int32)`` rounds to nearest
    even, as oneDNN and ``Tensor.float()`` both do). The same operations in the same order whichever
    kernel summed: the kernels differ in speed only, never in an answer."""
    if native.usable(acc) and dtype in (torch.float32, torch.bfloat16):
        return native.scale_rows(acc.contiguous(), s, None if m.bias is None else m.bias.float(), dtype, m.scale)
    y = acc.mul_(m.scale).mul_(s)
    if m.bias is not None:
        y = y.add_(m.bias.float())
    return y.to(dtype)


def dequantized_sums(xu: torch.Tensor, m: Int8Linear) -> torch.Tensor:
    """(rows, in) uint8 -> (rows, out) float32 sums: float32 matmuls over ``EXACT_K`` input features at a
    time (every partial sum an integer below 2^24: exact in any order), the pieces added in int32."""
    xf = xu.float().sub_(128.0)  # the int8 values, exactly
    k = xf.shape[1]
    if k <= EXACT_K:
        return F.linear(xf, m.weight.float())
    total = None
    for c in range(0, k, EXACT_K):
        part = F.linear(xf[:, c : c + EXACT_K], m.weight[:, c : c + EXACT_K].float()).to(torch.int32)
        total = part if total is None else total.add_(part)
    return total.float()


def int8_sums(xu: torch.Tensor, m: Int8Linear) -> torch.Tensor:
    """(rows, in) uint8 -> (rows, out) float32 sums: int8 x int8 -> int32 (``torch._int_mm``)."""
    xq = xu.bitwise_xor(128).view(torch.int8)  # u - 128, the same bytes with the top bit flipped
    rows = xq.shape[0]
    if xq.is_cuda and rows <= 16:  # cuBLASLt's int8 GEMM needs more than 16 rows: pad
        xq = F.pad(xq, (0, 0, 0, 17 - rows))
    acc = torch._int_mm(xq, m.weight.t())[:rows]  # (rows, out) int32; weight.t(): the (in, out) operand, column-major
    return acc.float()


def quantize_tokens(x: torch.Tensor, unsigned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, in) float -> (rows, in) int8 values and float32 scales (rows, 1): one symmetric scale per
    row (``max |x_row| / 127``), each value rounded to the nearest step. ``unsigned``: the values + 128
    as uint8 instead (zero point 128: what oneDNN's u8 x s8 product takes). One C pass where the native
    loops are built, else :func:`eager_quantize_tokens`, bit for bit the same."""
    if native.usable(x):
        u, scale = native.quantize_rows_u8(x)
        return (u if unsigned else u.bitwise_xor_(128).view(torch.int8)), scale
    return eager_quantize_tokens(x, unsigned)


def eager_quantize_tokens(x: torch.Tensor, unsigned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_tokens` in PyTorch operators (any device and dtype), in the fewest passes found: the
    range from two reductions (no ``abs`` copy); ``x / scale + 128.5`` truncated by the uint8 cast rounds to
    nearest (ties upward) in one step; ``u ^ 128`` viewed as int8 is ``u - 128``."""
    xf = x.float()
    top = torch.maximum(xf.amax(1, keepdim=True), xf.amin(1, keepdim=True).neg_())
    top = top.clamp_(min=1e-30)  # an all-zero row: values 0 (127 / top stays finite: 0 * inf would be NaN)
    u = torch.mul(xf, top.reciprocal().mul_(QMAX)).add_(128.5).to(torch.uint8)  # |x / scale| <= 127: 1.5..255.5
    scale = top.div_(QMAX)
    return (u if unsigned else u.bitwise_xor_(128).view(torch.int8)), scale


def onednn_prepack(weight: torch.Tensor) -> torch.Tensor:
    """int8 (out, in) -> oneDNN's prepacked int8 weight for the ``onednn`` kernel (CPU only, where oneDNN's
    product is exact: :func:`onednn_saturates`)."""
    if weight.device.type != "cpu":
        raise RuntimeError("oneDNN's int8 linear is a CPU kernel")
    if onednn_saturates():
        raise RuntimeError("oneDNN's u8 x s8 product saturates int16 pair sums on this CPU (no VNNI / AMX)")
    return _prepack(weight)


def _prepack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_prepack(weight, None)


@functools.cache
def unit_weights(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """oneDNN's weight scales and zero points, one shared pair per width: scales of 1, so its output is
    float32(acc) and :func:`epilogue` applies the weight scales like every kernel's; zero points 0 (symmetric)."""
    return torch.ones(n, dtype=torch.float32), torch.zeros(n, dtype=torch.long)


def _qlinear(xu: torch.Tensor, x_zero: int, packed: torch.Tensor, n: int) -> torch.Tensor:
    """oneDNN's ``float32((xu - x_zero) @ W.T)``: (rows, in) uint8 -> (rows, n) float32."""
    return torch.ops.onednn.qlinear_pointwise(xu, 1.0, x_zero, packed, *unit_weights(n), None,
                                              1.0, 0, torch.float32, "none", [], "")


@functools.cache
def onednn_saturates() -> bool:
    """Whether oneDNN's u8 x s8 product loses sums on this CPU: without VNNI or AMX its ``vpmaddubsw``
    saturates int16 pair sums (2 x 255 x 127 > 32767). Measured, not read from the CPU flags, on products
    at that limit at a decode and a prefill row count; when true the ``onednn`` kernel is not offered."""
    w = torch.full((32, 64), QMAX, dtype=torch.int8)
    packed = _prepack(w)
    exact = float(QMAX * QMAX * 64)  # each output: 64 products of 127 x 127, exact in float32
    return any(not bool((_qlinear(torch.full((rows, 64), 255, dtype=torch.uint8), 128, packed, 32) == exact).all())
               for rows in (1, 32))


def native_sums(xu: torch.Tensor, m: Int8Linear) -> torch.Tensor:
    """(rows, in) uint8 -> (rows, out) float32 sums by the project's C loops (pipeline/models/kernels/native.c):
    with AVX512-VNNI against the weight repacked once into 16-output blocks (vpdpbusd, weights streamed
    once per block of up to 8 rows: a decode step reads each weight once), else AVX2 on the plain weight."""
    xu = xu.contiguous()
    if m.packed is not None:
        return native.int8_products_vnni(xu, m.packed, m.out_features, m.weight_sums).float()
    return native.int8_products(xu, m.weight).float()


# each kernel's exact integer sums of (rows, in) uint8 activations against an Int8Linear's weight, as float32;
# onednn: oneDNN's product against m.packed (its layout)
SUMS = {"int8": int8_sums, "dequantize": dequantized_sums, "native": native_sums,
        "onednn": lambda xu, m: _qlinear(xu, 128, m.packed, m.out_features)}


def quantize_linears(model: nn.Module) -> int:
    """Replace the projections of every Attention and MLP in ``model`` (on the meta device, before
    loading) by :class:`Int8Linear` of the same shape; returns how many."""

    found = projections(model)
    for module, name in found:
        lin: nn.Linear = getattr(module, name)
        setattr(module, name, Int8Linear(lin.in_features, lin.out_features, lin.bias is not None))
    return len(found)


def median_times(fns: dict[str, Callable[[], object]], rounds: int = 7, budget_s: float = 0.3) -> dict[str, float]:
    """Median seconds of each of ``fns`` over up to ``rounds`` rounds (at least 3), after one warm-up
    call each. The calls interleave (each round times every function once, in a rotated order), so a
    burst of other work on the machine lands on every candidate alike, and the median drops the
    rounds it spoiled (on a busy machine single timings swing 100x: docs/performance-log.md)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # CUDA runs asynchronously
    names = list(fns)
    for name in names:
        fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            sync()
            t0 = time.perf_counter()
            fns[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
        if r >= 2 and time.perf_counter() - start > budget_s:
            break
    return {name: statistics.median(t) for name, t in times.items()}


@torch.inference_mode()
def choose_kernels(model: nn.Module, dtype: torch.dtype, rows: tuple[int, ...] = (32, 256),
                   table: KernelTable | None = None, release: Callable[[], object] | None = None) -> dict[str, dict]:
    """Choose the kernel of each distinct (in, out) shape of the stage's :class:`Int8Linear` layers
    (:func:`~pipeline.models.kernels.kernel_table.set_per_shape`: ``table``'s choice when given, else
    measured now by :func:`_measure`); returns ``{"INxOUT": {"kernel": ..., "rows": rows, "ms": {kernel:
    [median ms at each size timed]}}}``."""

    def plan(probe: Int8Linear) -> tuple[str, list[str], Callable[[], dict]]:
        alive, copies = _available(probe)
        shape = f"{probe.in_features}x{probe.out_features}"
        key = f"int8/{probe.weight.device.type}/{str(dtype).removeprefix('torch.')}/{shape}"
        return key, alive, functools.partial(_measure, probe, copies, alive, dtype, rows)

    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    return set_per_shape(layers, lambda m: (m.in_features, m.out_features), plan, table, release)


def _measure(probe: Int8Linear, copies: dict[str, Int8Linear], alive: list[str], dtype: torch.dtype,
             rows: tuple[int, ...]) -> dict:
    """Time ``alive`` kernels (each on its copy of ``probe`` from :func:`_available`) at each size of
    ``rows``: ``{"kernel": the least total time, "rows": rows, "ms": {kernel: [median ms per size]}}``.
    A kernel over 3x slower than the fastest at a size is not timed at the larger sizes and cannot win
    (on a CPU without VNNI a big prefill product in int8 would take seconds)."""
    gen = torch.Generator().manual_seed(0)
    ms: dict[str, list[float]] = {kernel: [] for kernel in alive}  # per size of rows
    for m_rows in rows:
        x = torch.randn(m_rows, probe.in_features, generator=gen).to(device=probe.weight.device, dtype=dtype)
        fns = {kernel: functools.partial(product, kernel, x, copies[kernel]) for kernel in alive}
        for kernel, seconds in median_times(fns).items():
            ms[kernel].append(round(seconds * 1e3, 4))
        fastest = min(ms[kernel][-1] for kernel in alive)
        alive = [kernel for kernel in alive if ms[kernel][-1] <= 3 * fastest]
    # each size counts alike (a kernel's time over the fastest's at that size, summed): a plain sum
    # would let the prefill size alone decide, where single-stream decode is a chat user's whole wait
    best = min(alive, key=lambda kernel: sum(t / min(ms[k][i] for k in alive) for i, t in enumerate(ms[kernel])))
    return {"kernel": best, "rows": list(rows), "ms": {kk: v for kk, v in ms.items() if v}}


def _available(probe: Int8Linear) -> tuple[list[str], dict[str, Int8Linear]]:
    """The kernels that run on ``probe``'s device and shape (one call each on a row of zeros; those that
    fail are logged and left out), each with a shallow copy of the probe to time it on: the copies share
    the probe's parameters and hold their own packed layout (the probe's plain weight stays)."""
    alive, copies = [], {}
    x = torch.zeros(1, probe.in_features, device=probe.weight.device)
    for kernel in KERNELS:
        try:
            copies[kernel] = other = copy.copy(probe)
            other.packed, other.weight_sums, other.kernel = None, None, kernel
            other._pack(kernel)
            product(kernel, x, other)
            alive.append(kernel)
        except (RuntimeError, AttributeError) as e:  # AttributeError: a torch without the op
            copies.pop(kernel, None)
            log.info("int8 kernel %s unavailable for %dx%d: %s", kernel, probe.in_features, probe.out_features,
                     str(e).splitlines()[0])
    return alive, copies


class DeferredNorm(nn.Module):
    """A norm whose one reader, an int8 projection, applies it while quantizing: passes x through
    (the norm stays a child, so the stage's parameters are unchanged)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def fuse_prologues(model: nn.Module) -> int:
    """On a CPU stage with int8 projections (whichever kernel), move what feeds a projection into its
    quantizing C pass (:func:`pipeline.models.kernels.native.quantize_rows_u8_fused`): the input RMSNorm of
    ``attn.qkv`` and ``mlp.up`` (pre-norm layers) and SiLU(gate) * up before a gated MLP's ``down``, so
    the float tensors in between are never written. Returns how many projections took a prologue."""

    floats = [p for p in model.parameters() if p.is_floating_point()]
    if native.library() is None or not floats or floats[0].dtype not in (torch.float32, torch.bfloat16) \
            or floats[0].device.type != "cpu":
        return 0
    fused = 0

    def int8(lin) -> bool:  # whichever kernel: the prologue must not depend on a timing
        return isinstance(lin, Int8Linear)

    def take_norm(lin: Int8Linear, norm) -> bool:
        if not (isinstance(norm, Norm) and norm.kind == "rms" and not norm.tile and int8(lin)):
            return False
        lin.prologue, lin.norm_eps = "rms", float(norm.eps)
        lin.norm_weight = (norm.weight.detach().float() + norm.offset).contiguous()
        return True

    for block in model.modules():
        if not isinstance(block, Block) or block.spec.parallel_residual or not block.spec.pre_norm:
            continue
        if take_norm(block.attn.qkv, block.n1):
            block.n1, fused = DeferredNorm(block.n1), fused + 1
        if isinstance(block.mlp, MLP) and block.n2 is not None and take_norm(block.mlp.up, block.n2):
            block.n2, fused = DeferredNorm(block.n2), fused + 1
        mlp = block.mlp
        if isinstance(mlp, MLP) and mlp.gated and block.spec.activation == "silu" and int8(mlp.down):
            mlp.down.prologue, fused = "silu_gate", fused + 1
    return fused
