"""int8 weights for a stage's linear layers (``--quantize int8``), with the matmul kernel chosen by measurement.

Each projection of a decoder layer (``attn.qkv``, ``attn.o``, ``mlp.up``, ``mlp.down``, a shared
expert's too) becomes an :class:`Int8Linear`: int8 weights (out, in) with one symmetric float32
scale per output channel (``scale = max |w_row| / 127``), computed from the checkpoint's tensor
as it is loaded, so a stage never holds its layers in float. Embeddings, norms, the head, MoE
routers and routed experts stay in the compute dtype.

Three kernels compute ``x @ W.T`` from the int8 weights:

- ``int8``: dynamic per-token activation quantization (one symmetric scale per row of ``x``),
  ``torch._int_mm`` (int8 x int8 -> int32; oneDNN on CPU, cuBLASLt on CUDA, the kernel torchao's
  int8 dynamic-activation path calls), then both scales applied in float32;
- ``onednn`` (CPU): the same per-token quantization and the same integer products, against int8
  weights reordered once into oneDNN's blocked layout (``torch.ops.onednn.qlinear_prepack``, the
  pair PyTorch's compiler uses for its x86 int8 models). ``torch._int_mm`` re-reads the plain
  (out, in) weight on every call; the prepacked product measured ~2x faster at 1-32 rows on an AMX
  Xeon (2 threads, 768x2304: 0.055 against 0.10 ms at 32 rows). The activations go in as uint8 with
  zero point 128 (``q + 128``: exactly the int8 values; oneDNN's u8 x s8 path is its fastest at
  prefill sizes), the per-channel weight scales as oneDNN's output scales, the per-row scale after;
  the packed copy replaces the plain weight. On CPUs without VNNI / AMX oneDNN's u8 x s8 product
  saturates int16 pair sums (:func:`onednn_saturates`): there it runs as two exact products;
- ``dequantize``: the int8 weights cast to the compute dtype for each matmul, an ordinary matmul,
  then the per-channel scales (what a fake-quantized float model computes, to float rounding).

Which is faster depends on the machine: on AVX-512 VNNI / AMX CPUs and on GPUs the int8 product
is several times a float one; on CPUs without VNNI ``torch._int_mm`` is ~30x slower than float. So
:func:`choose_kernels` times both on the stage's own shapes when the stage is loaded and keeps the
faster for each shape; the choice is logged and reported in the run summary.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.kernels import native
from pipeline.models.decoder import projections
from pipeline.models.decoder import MLP, Block, Norm

log = logging.getLogger(__name__)

KERNELS = ("int8", "onednn", "dequantize")
QMAX = 127  # symmetric: -127..127 (-128 unused, so negation is exact)


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


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights and per-output-channel scales; ``kernel`` picks the matmul."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # a parameter, so the loader maps it to the checkpoint tensor like the float weight it replaces
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.kernel = "dequantize"
        self.packed = None  # kernel "onednn": oneDNN's prepacked copy of the weight (an opaque tensor)
        self.prologue = None  # what the quantizing pass computes first (fuse_prologues): "rms" or "silu_gate"
        self.norm_weight, self.norm_eps = None, 0.0  # "rms": the deferred norm's float32 weight and eps

    def set_kernel(self, kernel: str) -> None:
        """Use ``kernel`` from now on. ``onednn`` reorders the weight once and frees the plain copy
        (so no other kernel can be set afterwards)."""
        if kernel == "onednn" and self.packed is None:
            self.packed = onednn_prepack(self.weight)
            self.weight = nn.Parameter(torch.empty(0, dtype=torch.int8, device=self.weight.device), requires_grad=False)
        elif kernel != "onednn" and self.packed is not None:
            raise ValueError("this layer's int8 weight lives in oneDNN's packed layout only")
        self.kernel = kernel

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.scale.dtype != torch.float32:  # module.to(bfloat16) casts buffers: the scales stay float32
            self.scale = self.scale.float()
        return self

    @torch.no_grad()
    def load_float(self, w: torch.Tensor) -> None:
        """Quantize the checkpoint's float weight (out, in) into this module (on its device)."""
        q, scale = quantize_rows(w.to(self.weight.device))
        self.weight.copy_(q)
        self.scale.copy_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (m, in)
        if self.prologue is not None:  # the kernel is onednn, the library loaded (fuse_prologues)
            xu, s = native.quantize_rows_u8_fused(flat, self.prologue, self.norm_weight, self.norm_eps)
            y = onednn_mm(flat, self, self.packed, (xu, s))
        else:
            y = (onednn_mm(flat, self, self.packed) if self.kernel == "onednn" else int8_mm(flat, self)
                 if self.kernel == "int8" else dequantized_mm(flat, self))
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, kernel={self.kernel}"


def dequantized_mm(x: torch.Tensor, m: Int8Linear) -> torch.Tensor:
    """(rows, in) -> (rows, out) through the int8 weights cast to x's dtype (one temporary per call).

    The per-output-channel scale is applied to the product, not to the weights: one pass over the
    weights less (int8 values are exact in every float dtype), and float32 / bfloat16 have the range
    for the unscaled sums. float16 has not (127 x 4096 x a large activation overflows it): there the
    weights are scaled first."""
    if x.dtype == torch.float16:
        return F.linear(x, m.weight.to(x.dtype) * m.scale.to(x.dtype)[:, None], m.bias)
    y = F.linear(x, m.weight.to(x.dtype))
    y = y * m.scale if x.dtype == torch.float32 else (y.float() * m.scale).to(x.dtype)
    return y if m.bias is None else y + m.bias


def int8_mm(x: torch.Tensor, m: Int8Linear) -> torch.Tensor:
    """(rows, in) -> (rows, out): rows quantized to int8 with one scale each, int8 x int8 -> int32."""
    xq, s = quantize_tokens(x)  # (rows, in) int8, (rows, 1)
    rows = xq.shape[0]
    if xq.is_cuda and rows <= 16:  # cuBLASLt's int8 GEMM needs more than 16 rows: pad
        xq = F.pad(xq, (0, 0, 0, 17 - rows))
    acc = torch._int_mm(xq, m.weight.t())[:rows]  # (rows, out) int32; weight.t(): the (in, out) operand, column-major
    y = acc.float() * s * m.scale
    if m.bias is not None:
        y = y + m.bias.float()
    return y.to(x.dtype)


def quantize_tokens(x: torch.Tensor, unsigned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, in) float -> (rows, in) int8 values and float32 scales (rows, 1): one symmetric scale per
    row (``max |x_row| / 127``), each value rounded to the nearest step. ``unsigned``: the values + 128
    as uint8 instead (zero point 128: what oneDNN's u8 x s8 product takes).

    Five passes over the activations in eager mode, the fewest found (this runs before every int8
    product; written plainly, with ten, it took nearly as long as the products in a generation
    profile, and this form measured 10-30% off each projection): the row's range from two reductions
    (no ``abs`` copy), then ``x / scale + 128.5`` truncated by the cast to uint8, which rounds to
    nearest in one step (ties upward) where ``round`` + ``clamp`` + ``add`` took three; int8 values
    are the same bytes with the top bit flipped (``u ^ 128`` viewed as int8 is ``u - 128``).

    On a CPU with a C compiler, one pass of :mod:`pipeline.models.kernels.native` instead, bit for bit the same."""
    if native.usable(x):
        u, scale = native.quantize_rows_u8(x)
        return (u if unsigned else u.bitwise_xor_(128).view(torch.int8)), scale
    return eager_quantize_tokens(x, unsigned)


def eager_quantize_tokens(x: torch.Tensor, unsigned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_tokens` in PyTorch operators (any device and dtype)."""
    xf = x.float()
    top = torch.maximum(xf.amax(1, keepdim=True), xf.amin(1, keepdim=True).neg_())
    top = top.clamp_(min=1e-30)  # an all-zero row: values 0 (127 / top stays finite: 0 * inf would be NaN)
    u = torch.mul(xf, top.reciprocal().mul_(QMAX)).add_(128.5).to(torch.uint8)  # |x / scale| <= 127: 1.5..255.5
    scale = top.div_(QMAX)
    return (u if unsigned else u.bitwise_xor_(128).view(torch.int8)), scale


def onednn_prepack(weight: torch.Tensor) -> torch.Tensor:
    """int8 (out, in) -> oneDNN's prepacked int8 weight for :func:`onednn_mm` (CPU only)."""
    if weight.device.type != "cpu":
        raise RuntimeError("oneDNN's int8 linear is a CPU kernel")
    return torch.ops.onednn.qlinear_prepack(weight, None)


@functools.cache
def zero_points(n: int) -> torch.Tensor:
    """The weights' zero points for oneDNN (symmetric: all 0), one shared tensor per width."""
    return torch.zeros(n, dtype=torch.long)


def _qlinear(xu: torch.Tensor, x_scale: float, x_zero: int, packed: torch.Tensor, m: Int8Linear) -> torch.Tensor:
    """oneDNN's ``x_scale * (xu - x_zero) @ W.T * weight scales``: (rows, in) uint8 -> (rows, out) float32."""
    return torch.ops.onednn.qlinear_pointwise(xu, x_scale, x_zero, packed, m.scale, zero_points(m.out_features), None,
                                              1.0, 0, torch.float32, "none", [], "")


@functools.cache
def onednn_saturates() -> bool:
    """Whether oneDNN's u8 x s8 product loses sums on this CPU. Without VNNI or AMX (AVX2 / AVX-512
    only) it multiplies with ``vpmaddubsw``, which adds each pair of u8 x s8 products into an int16
    and saturates: 2 x 255 x 127 = 64770 > 32767, so a row of large activations against large weights
    of one sign comes out wrong (an AVX2 EPYC measured logits off by 0.25 and single products by 4).
    Measured, not read from the CPU flags, on the products that saturate there (all 127, every pair
    at the limit), at a decode and a prefill row count. When true, :func:`onednn_mm` splits the
    activations so that no pair can pass 2 x 127 x 127 = 32258."""
    w = torch.full((32, 64), QMAX, dtype=torch.int8)
    packed, probe = onednn_prepack(w), Int8Linear(64, 32, False)
    exact = float(QMAX * QMAX * 64)  # each output: 64 products of 127 x 127, exact in float32
    return any(not bool((_qlinear(torch.full((rows, 64), 255, dtype=torch.uint8), 1.0, 128, packed, probe) == exact).all())
               for rows in (1, 32))


def onednn_mm(x: torch.Tensor, m: Int8Linear, packed: torch.Tensor,
              quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """(rows, in) -> (rows, out): :func:`int8_mm`'s arithmetic against ``packed`` (oneDNN's layout);
    ``quantized``: x's uint8 values and scales already computed (x then only gives the dtype)."""
    xu, s = quantize_tokens(x, unsigned=True) if quantized is None else quantized  # (rows, in) uint8, (rows, 1)
    if onednn_saturates():  # u = 2h + l: (u - 128) . w = 2 (h - 64) . w + l . w, each product exact
        y = _qlinear(xu >> 1, 2.0, 64, packed, m).add_(_qlinear(xu & 1, 1.0, 0, packed, m))
    else:
        y = _qlinear(xu, 1.0, 128, packed, m)
    if native.usable(y) and x.dtype in (torch.float32, torch.bfloat16):
        return native.scale_rows(y, s, None if m.bias is None else m.bias.float(), x.dtype)
    y = y.mul_(s) if m.bias is None else torch.addcmul(m.bias.float(), y, s)
    return y.to(x.dtype)


def quantize_linears(model: nn.Module) -> int:
    """Replace the projections of every Attention and MLP in ``model`` (on the meta device, before
    loading) by :class:`Int8Linear` of the same shape; returns how many."""

    found = projections(model)
    for module, name in found:
        lin: nn.Linear = getattr(module, name)
        setattr(module, name, Int8Linear(lin.in_features, lin.out_features, lin.bias is not None))
    return len(found)


def _time(fn, budget_s: float = 0.05, reps: int = 5) -> float:
    """Best seconds of ``fn()`` over up to ``reps`` calls (after one warm-up), within about ``budget_s``."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # CUDA runs asynchronously
    fn()
    best, start = float("inf"), time.perf_counter()
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best


@torch.inference_mode()
def choose_kernels(model: nn.Module, dtype: torch.dtype, rows: tuple[int, ...] = (32, 256)) -> dict[str, dict]:
    """Time the kernels on each distinct (in, out) shape of the stage's :class:`Int8Linear` layers
    with ``rows`` token rows (a decode micro-batch, a prefill chunk), set the one with the least
    total time on every layer of that shape, and return ``{"INxOUT": {"kernel": ..., "rows": rows,
    "ms": {kernel: [best ms at each size timed]}}}``. A kernel that fails (e.g. no int8 GEMM for
    this device or shape) is dropped; one over 3x slower than the fastest at a size is not timed at
    the larger sizes (it lost already: on a CPU without VNNI a big prefill product in int8 would
    take seconds) and cannot be chosen."""
    by_shape: dict[tuple[int, int], list[Int8Linear]] = {}
    for m in model.modules():
        if isinstance(m, Int8Linear):
            by_shape.setdefault((m.in_features, m.out_features), []).append(m)
    chosen = {}
    gen = torch.Generator().manual_seed(0)
    for (k, n), mods in by_shape.items():
        probe = mods[0]
        ms: dict[str, list[float]] = {kernel: [] for kernel in KERNELS}  # per size of rows
        alive, packed = list(KERNELS), None
        for m_rows in rows:
            x = torch.randn(m_rows, k, generator=gen).to(device=probe.weight.device, dtype=dtype)
            for kernel in list(alive):
                try:
                    if kernel == "onednn" and packed is None:
                        packed = onednn_prepack(probe.weight)  # a copy to time; the layers pack if it wins
                    fn = {"int8": lambda: int8_mm(x, probe), "dequantize": lambda: dequantized_mm(x, probe),
                          "onednn": lambda: onednn_mm(x, probe, packed)}[kernel]
                    ms[kernel].append(round(_time(fn) * 1e3, 4))
                except (RuntimeError, AttributeError) as e:  # AttributeError: a torch without the op
                    log.info("int8 kernel %s unavailable for %dx%d: %s", kernel, k, n, str(e).splitlines()[0])
                    alive.remove(kernel)
            fastest = min(ms[kernel][-1] for kernel in alive)
            alive = [kernel for kernel in alive if ms[kernel][-1] <= 3 * fastest]
        best = min(alive, key=lambda kernel: sum(ms[kernel]))
        for m in mods:
            m.set_kernel(best)
        chosen[f"{k}x{n}"] = {"kernel": best, "rows": list(rows), "ms": {kk: v for kk, v in ms.items() if v}}
    return chosen


class DeferredNorm(nn.Module):
    """A norm whose one reader, an int8 projection, applies it while quantizing: passes x through
    (the norm stays a child, so the stage's parameters are unchanged)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def fuse_prologues(model: nn.Module) -> int:
    """On a CPU stage whose projections run oneDNN's int8 product, move what feeds each projection
    into its quantizing pass (one C loop, :func:`pipeline.models.kernels.native.quantize_rows_u8_fused`):
    the input RMSNorm of ``attn.qkv`` and of ``mlp.up`` (pre-norm layers, where the norm's output has
    no other reader) and SiLU(gate) * up of a gated MLP's ``down``. The float tensors in between
    are never written, and four to six eager operators a projection go (decode micro-batches spend
    about as long in them as in the product). Returns how many projections took a prologue."""

    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    if native.library() is None or dtype not in (torch.float32, torch.bfloat16):
        return 0
    fused = 0

    def onednn(lin) -> bool:
        return isinstance(lin, Int8Linear) and lin.kernel == "onednn"

    def take_norm(lin: Int8Linear, norm) -> bool:
        if not (isinstance(norm, Norm) and norm.kind == "rms" and not norm.tile and onednn(lin)):
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
        if isinstance(mlp, MLP) and mlp.gated and block.spec.activation == "silu" and onednn(mlp.down):
            mlp.down.prologue, fused = "silu_gate", fused + 1
    return fused
