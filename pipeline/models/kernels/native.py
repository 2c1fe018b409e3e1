"""CPU loops in C (``native.c``), compiled once per machine and loaded with ctypes: the element-wise
loops around the int8 product, the ``native`` int8 products (AVX512-VNNI, else AVX2), decode attention
over per-row lengths and bfloat16 products in float32. Each computes its PyTorch fallback's float32
operations in the same order (no FMA contraction: bit for bit, ``test_int8.py`` asserts it); callers
fall back to PyTorch when the library is None (no compiler, a failed build: logged once;
``DIST_RUNNER_NATIVE=0``). Why, and how it is built and cached: docs/usage/quantization.md.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from pipeline.paths import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
_X86 = platform.machine().lower() in ("x86_64", "amd64")


def _march() -> str:
    """``-march=native``, unless PyTorch's own kernels are held to less than this x86 CPU has
    (``ATEN_CPU_CAPABILITY=avx2`` or ``default``): then the same level (x86-64-v3: AVX2 and FMA; v2),
    so that one variable runs the whole process as on such a CPU (what tests and benchmarks of the
    AVX2 paths use on an AVX-512 machine)."""
    level = {"AVX2": "x86-64-v3", "DEFAULT": "x86-64-v2"}.get(torch.backends.cpu.get_cpu_capability())
    return f"-march={level}" if _X86 and level else "-march=native"


def flags(march: str) -> tuple[str, ...]:
    return ("-O3", march, *(("-mtune=native", "-mprefer-vector-width=512") if _X86 else ()), "-ffp-contract=off",
            "-fopenmp", "-std=c11", "-fPIC", "-shared")  # 512-bit vectors: gcc's AVX-512 default is 256
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_VOID_FUNCTIONS = {  # name -> argument types, of native.c's functions that return nothing
    "quantize_rows_u8": [_PTR, _I64, _I64, _I64, _INT, _PTR, _PTR],
    "quantize_rows_u8_fused": [_PTR, _I64, _I64, _I64, _INT, _INT, _PTR, ctypes.c_float, _PTR, _PTR],
    "scale_rows": [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _INT, _PTR],
    "decode_attention": [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64,
                         ctypes.c_float, _INT, _INT, _PTR],
    "kv_store_i8": [_PTR, _I64, _I64, _I64, _I64, _I64, _INT, _PTR, _I64, _PTR, _PTR],
    "pack_vnni": [_PTR, _I64, _I64, _PTR],
    "int8_products_vnni": [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR],
    "bf16_products": [_PTR, _I64, _I64, _PTR, _I64, _PTR],
}


def cache_dir() -> Path:
    """``$DIST_INFER_CACHE/kernels``, else ``~/.cache/dist-inference-runner/kernels`` (the project's cache root)."""

    return cache_root() / "kernels"


def cpuinfo() -> list[str]:
    """/proc/cpuinfo's lines up to the first CPU's ``flags`` (ARM: ``Features``) line; [] without the file."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
    end = next((i for i, line in enumerate(lines) if line.startswith(("flags", "Features"))), len(lines))
    return lines[: end + 1]


def _build(compiler: str, flags: tuple[str, ...]) -> Path:
    source, cpu = SOURCE.read_bytes(), cpuinfo()
    cpu_flags = cpu[-1] if cpu and cpu[-1].startswith(("flags", "Features")) else platform.processor()  # as written
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), compiler.encode(), cpu_flags.encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    target = cache_dir() / f"native-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp], check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library(march: str | None = None) -> ctypes.CDLL | None:
    """The loaded kernels, or None (disabled, no compiler, or the build failed: logged once). ``march``:
    the ``-march=`` flag (default :func:`_march`; the tests build the AVX2 loops on an AVX-512 CPU)."""
    if os.environ.get("DIST_RUNNER_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        log.info("no C compiler found: int8's quantization and CPU decode attention run in PyTorch operators (slower)")
        return None
    lib, with_openmp = None, flags(march or _march())
    for fl in (with_openmp, tuple("-fopenmp-simd" if f == "-fopenmp" else f for f in with_openmp)):  # then without
        try:
            lib = ctypes.CDLL(str(_build(compiler, fl)))
            break
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            error = f"{e}{': ' + detail.decode(errors='replace')[-500:] if detail else ''}"
    if lib is None:
        log.warning("could not build the native CPU loops (int8 helpers, decode attention) with %s (%s): using "
                    "PyTorch operators", compiler, error)
        return None
    for name, args in _VOID_FUNCTIONS.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, None
    lib.int8_products.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR]  # these and has_*: ctypes' int result
    lib.int8_products_path.argtypes = [_I64]
    return lib


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x``: a CPU float32 / bfloat16 matrix with contiguous rows."""
    return (x.device.type == "cpu" and x.dtype in _DTYPES and x.dim() == 2 and x.stride(1) == 1
            and library() is not None)


def quantize_rows_u8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, in) -> uint8 (rows, in) with zero point 128 and float32 scales (rows, 1): what
    :func:`pipeline.models.kernels.int8.quantize_tokens` computes with ``unsigned=True``. Needs :func:`usable`."""
    rows, cols = x.shape
    u = torch.empty(rows, cols, dtype=torch.uint8)
    scale = torch.empty(rows, 1, dtype=torch.float32)
    library().quantize_rows_u8(x.data_ptr(), rows, cols, x.stride(0), _DTYPES[x.dtype], u.data_ptr(), scale.data_ptr())
    return u, scale


def quantize_rows_u8_fused(x: torch.Tensor, prologue: str, weight: torch.Tensor | None,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_u8` of what feeds a projection, computed in float32 in the same pass:
    ``prologue`` "rms": x (rows, in) RMS-normalized and scaled by ``weight`` (float32, in); "silu_gate":
    x (rows, 2 in) = [gate | up] -> silu(gate) * up. Needs :func:`usable` and contiguous rows."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, width = x.shape
    cols = width // 2 if prologue == "silu_gate" else width
    u = torch.empty(rows, cols, dtype=torch.uint8)
    scale = torch.empty(rows, 1, dtype=torch.float32)
    library().quantize_rows_u8_fused(x.data_ptr(), rows, cols, x.stride(0), _DTYPES[x.dtype],
                                     1 if prologue == "rms" else 2, None if weight is None else weight.data_ptr(),
                                     eps, u.data_ptr(), scale.data_ptr())
    return u, scale


def scale_rows(acc: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
               w: torch.Tensor | None = None) -> torch.Tensor:
    """``(acc * w * s + bias).to(dtype)``, multiplied in that order, for a contiguous float32 ``acc``
    (rows, out), ``s`` (rows, 1), float32 ``w`` (out,) or None and a float32 ``bias`` (out,) or None;
    float32 results overwrite ``acc``."""
    rows, cols = acc.shape
    out = acc if dtype == torch.float32 else torch.empty(rows, cols, dtype=dtype)
    library().scale_rows(acc.data_ptr(), rows, cols, s.data_ptr(), None if w is None else w.data_ptr(),
                         None if bias is None else bias.data_ptr(), _DTYPES[dtype], out.data_ptr())
    return out


def int8_products_path(k: int) -> str | None:
    """Which int8 product loop this CPU's build has for ``k`` input features: "vnni" (AVX512-VNNI,
    k % 4 == 0: :func:`pack_vnni` + :func:`int8_products_vnni`), "avx2" (plain weights, k % 16 == 0:
    :func:`int8_products`), or None (no library, or no loop for k)."""
    lib = library()
    if lib is None:
        return None
    if lib.has_vnni() and k % 4 == 0:
        return "vnni"
    return "avx2" if lib.int8_products_path(k) else None


def pack_vnni(w: torch.Tensor) -> torch.Tensor:
    """(n, k) int8 -> the VNNI layout (blocks of 16 outputs, 4 input features a lane; native.c's pack_vnni)
    as a flat int8 tensor of ceil(n / 16) x 16 x k bytes. Needs the "vnni" path."""
    n, k = w.shape
    p = torch.empty((n + 15) // 16 * 16 * k, dtype=torch.int8)
    library().pack_vnni(w.contiguous().data_ptr(), n, k, p.data_ptr())
    return p


def int8_products_vnni(u: torch.Tensor, p: torch.Tensor, n: int, wsum: torch.Tensor) -> torch.Tensor:
    """(rows, k) uint8 (int8 values + 128) x a :func:`pack_vnni` weight of n outputs -> (rows, n) int32, the
    exact sums ``(u - 128) @ w.T``; ``wsum`` (n,) int32 = ``w.sum(1)``."""
    rows, k = u.shape
    acc = torch.empty(rows, n, dtype=torch.int32)
    library().int8_products_vnni(u.data_ptr(), rows, k, p.data_ptr(), n, wsum.data_ptr(), acc.data_ptr())
    return acc


def int8_products(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(rows, k) uint8 (int8 values + 128) x (n, k) int8 -> (rows, n) int32, the exact sums
    ``(u - 128) @ w.T`` (AVX2, plain layout). Needs the "avx2" path; contiguous inputs."""
    rows, k = u.shape
    n = w.shape[0]
    acc = torch.empty(rows, n, dtype=torch.int32)
    if not library().int8_products(u.data_ptr(), rows, k, w.data_ptr(), n, None, acc.data_ptr()):
        raise RuntimeError(f"no native int8 product for {k} input features on this CPU")
    return acc


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, ends: torch.Tensor,
                     window: int, scale: float) -> torch.Tensor:
    """One query per row against its own cached keys: q (b, heads, 1, d) with unit stride in d; k / v
    one layer's contiguous cache (cache rows, kv heads, cols, d) of q's dtype (float32 / bfloat16), or
    int8 records (cache rows, kv heads, cols, d + 4) (:mod:`.kv_cache`); ``rows`` / ``ends`` int64
    (b,): each row's cache row and the columns it reads, ``[0, end)`` or the last ``window`` of them.
    Returns (b, heads, 1, d) in q's dtype. Threads: PyTorch's OpenMP pool."""
    b, heads, _, d = q.shape
    out = torch.empty(b, heads, 1, d, dtype=q.dtype)
    library().decode_attention(q.data_ptr(), b, heads, q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), k.shape[1],
                               k.shape[2], d, rows.data_ptr(), ends.data_ptr(), window, scale, _DTYPES[q.dtype],
                               int(k.dtype == torch.int8), out.data_ptr())
    return out


def kv_store_i8(x: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> None:
    """Quantize x (n, kv heads, d) (float32 / bfloat16, unit stride in d) into one layer's int8 record
    cache (cache rows, kv heads, cols, d + 4) at cache row ``rows[i]``, column ``cols[i]`` (int64, n):
    what :func:`pipeline.cache.kv_cache.quantize_records` computes, bit for bit."""
    n, kvh, d = x.shape
    library().kv_store_i8(x.data_ptr(), n, kvh, d, x.stride(0), x.stride(1), _DTYPES[x.dtype], cache.data_ptr(),
                          cache.shape[2], rows.data_ptr(), cols.data_ptr())


def bf16_loop() -> bool:
    """Whether this build has a loop for :func:`bf16_products` (the AVX512-BF16 dot product, else AVX2
    with FMA) and OpenMP (the product it replaces runs on every thread)."""
    lib = library()
    return lib is not None and bool(lib.bf16_path()) and bool(lib.has_openmp())


def bf16_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`bf16_products` computes ``x @ weight.T``: both bfloat16 on the CPU, a hidden size
    that is a multiple of 32, a contiguous weight and :func:`bf16_loop`."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.bfloat16 and x.shape[-1] % 32 == 0
            and weight.is_contiguous() and bf16_loop())


def bf16_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(rows, h) bfloat16 x (n, h) bfloat16 -> (rows, n) float32 (a head's logits, a projection's outputs
    before rounding), the products summed in float32, the weight read as it is stored. A row's outputs do
    not depend on the other rows or the threads. Needs :func:`bf16_usable`."""
    x = x.contiguous()
    rows, h = x.shape
    out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
    library().bf16_products(x.data_ptr(), rows, h, weight.data_ptr(), weight.shape[0], out.data_ptr())
    return out


@functools.cache
def decode_dtypes() -> tuple[torch.dtype, ...]:
    """Where :func:`decode_attention` measured faster than PyTorch's kernels: float32 (against batched
    matmuls over runs of rows); bfloat16 only with the AVX512-BF16 dot product (against the flash
    kernel; with a float32 conversion pass instead it measured level, so flash stays)."""
    lib = library()
    if lib is None or not lib.has_openmp():  # built without OpenMP: one thread against PyTorch's pool, unmeasured
        return ()
    return (torch.float32, torch.bfloat16) if lib.has_bf16_dot() else (torch.float32,)


def decode_usable(cache: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`decode_attention` serves a decode step over ``cache`` with queries in ``dtype``:
    a cache in ``dtype`` where it measured faster (:func:`decode_dtypes`); an int8 record cache
    always (the alternative dequantizes every row's columns into a copy each step)."""
    if cache.device.type != "cpu" or library() is None:
        return False
    return dtype in _DTYPES if cache.dtype == torch.int8 else cache.dtype == dtype and dtype in decode_dtypes()
