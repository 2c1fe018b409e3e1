"""The KV cache of one micro-batch on one stage, preallocated: each row keeps its tokens at columns
``0..len-1`` (see :mod:`pipeline.models.decoder`). ``--kv-cache-dtype int8`` (CPU) keeps records of
``head_dim + 4`` int8 bytes, the values then their float32 scale, so that keys, values and scales move
together; decode attention reads them directly, every other reader gets a dequantized copy from
:meth:`KVCache.read` (docs/usage/quantization.md, "int8 KV cache").
"""

from __future__ import annotations

import mmap

import torch

from pipeline.models.device import to_device
from pipeline.models.kernels import native
from pipeline.models.spec import DecoderSpec


def zeroed(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.zeros(shape)``; on the CPU, large tensors in fresh anonymous memory instead, which the
    kernel hands out already zero and maps page by page as it is first written: a cache is sized for its
    longest possible rows, and ``torch.zeros`` would touch every page up front (docs/performance-log.md)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < 1 << 20:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the mapping


def quantize_records(x: torch.Tensor) -> torch.Tensor:
    """(..., d) float -> (..., d + 4) int8 records: x * (127 / max |x|) rounded to nearest even, then
    the float32 scale max |x| / 127 as four bytes (an all-zero vector: zeros, scale 0)."""
    xf = x.float()
    top = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, 127.0 / top, torch.zeros((), dtype=torch.float32))
    values = (xf * inv).round().to(torch.int8)
    return torch.cat([values, (top / 127.0).view(torch.int8)], dim=-1)


def dequantize_records(records: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., d + 4) int8 records -> (..., d) in ``dtype`` (values times scale, in float32)."""
    d = records.shape[-1] - 4
    return (records[..., :d].float() * records[..., d:].contiguous().view(torch.float32)).to(dtype)


def int8_layer_bytes(spec: DecoderSpec) -> int:
    """Bytes of int8 keys + values one token position takes in one layer: a record per KV head each."""
    return 2 * spec.num_kv_heads * (spec.head_dim + 4)


class KVCache:
    """Preallocated keys/values of one micro-batch on one stage: (layers, rows, kv_heads, cols, head_dim)
    in the compute dtype, or with ``int8`` records (layers, rows, kv_heads, cols, head_dim + 4)."""

    def __init__(self, layers: int, rows: int, cols: int, spec: DecoderSpec, dtype, device, int8: bool = False):
        width = spec.head_dim + 4 if int8 else spec.head_dim
        shape = (layers, rows, spec.num_kv_heads, cols, width)
        self.k = zeroed(shape, torch.int8 if int8 else dtype, device)
        self.v = zeroed(shape, self.k.dtype, device)
        self.int8 = int8
        # longrope: which rows use the long factors (decided once, when the row's prompt is prefilled)
        self.long_rope = torch.zeros(rows, dtype=torch.bool, device=device)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def cols(self) -> int:
        return self.k.shape[3]

    def store(self, layer: int, rows: torch.Tensor, cols: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write keys / values (..., kv_heads, head_dim) at cache rows ``rows`` and columns ``cols``
        (index tensors broadcasting to k's leading shape)."""
        if not self.int8:
            self.k[layer][rows, :, cols] = k
            self.v[layer][rows, :, cols] = v
            return
        if native.library() is not None and k.device.type == "cpu" and k.dtype in (torch.float32, torch.bfloat16):
            lead = k.shape[:-2]
            rows, cols = (t.broadcast_to(lead).reshape(-1).to(torch.int64).contiguous() for t in (rows, cols))
            for x, cache in ((k, self.k[layer]), (v, self.v[layer])):
                x = x.reshape(-1, *x.shape[-2:])
                native.kv_store_i8(x if x.stride(-1) == 1 else x.contiguous(), cache, rows, cols)
            return
        self.k[layer][rows, :, cols] = quantize_records(k)
        self.v[layer][rows, :, cols] = quantize_records(v)

    def read(self, layer: int, rows, cols: slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (rows, kv_heads, cols, head_dim) of cache rows ``rows`` (a slice or an index
        tensor), columns ``cols``, in ``dtype``: views of a float cache, dequantized copies of int8."""
        k, v = self.k[layer][rows, :, cols], self.v[layer][rows, :, cols]
        return (dequantize_records(k, dtype), dequantize_records(v, dtype)) if self.int8 else (k, v)

    def fork(self, src: int, dsts: list[int], ncols: int) -> None:
        """Copy row ``src``'s first ``ncols`` columns to ``dsts`` (best_of shares one prefill)."""
        idx = to_device(dsts, self.k.device, torch.long)
        # copies: torch refuses a source that is a view of the destination (one layer, every column)
        self.k[:, idx, :, :ncols] = self.k[:, src : src + 1, :, :ncols].clone()
        self.v[:, idx, :, :ncols] = self.v[:, src : src + 1, :, :ncols].clone()
        self.long_rope[idx] = self.long_rope[src].clone()
