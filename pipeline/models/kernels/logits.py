"""The head's matmul with float32 output for any weight dtype: a bf16/fp16 ``lm_head`` would round every
logit before the float32 log-softmax. Products accumulate in float32: on CUDA by ``torch.mm(...,
out_dtype=torch.float32)``; on a CPU with the native bf16 loop by :func:`.native.bf16_products`; elsewhere
by casting the weight a block of vocabulary rows at a time into one float32 buffer kept per thread
(a fresh tensor per block fragments a CPU stage's heap: pipeline.runtime.host_memory).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from pipeline.models.kernels import native

VOCAB_BLOCK = 8192  # vocabulary rows cast at a time (CPU, low precision)
_blocks = threading.local()  # .buf: this thread's float32 block buffer


def _block_buffer(hidden: int, device: torch.device) -> torch.Tensor:
    """(VOCAB_BLOCK, hidden) float32, reused across calls of this thread."""
    buf = getattr(_blocks, "buf", None)
    if buf is None or buf.shape[1] != hidden or buf.device != device:
        buf = _blocks.buf = torch.empty(VOCAB_BLOCK, hidden, dtype=torch.float32, device=device)
    return buf


def block_buffer_bytes() -> int:
    """Bytes of this thread's float32 block buffer (0 before the head first ran here), for the
    stage's memory account (pipeline.runtime.memory)."""
    buf = getattr(_blocks, "buf", None)
    return 0 if buf is None else buf.nbytes


def float32_linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   linear=F.linear) -> torch.Tensor:
    """``h @ weight.T + bias`` as float32 logits. h (..., hidden); weight (vocab, hidden). ``linear``:
    the float32 product (batch-invariant stages pass :func:`~.invariant.fixed_linear`)."""
    if weight.dtype == torch.float32:
        return linear(h.float(), weight, bias)
    flat = h.reshape(-1, h.shape[-1])
    if weight.is_cuda and linear is F.linear:
        out = torch.mm(flat, weight.t(), out_dtype=torch.float32)
    elif linear is F.linear and native.bf16_usable(flat, weight):
        out = native.bf16_products(flat, weight)
    else:
        x, vocab = flat.float(), weight.shape[0]
        out = torch.empty(x.shape[0], vocab, dtype=torch.float32, device=x.device)
        buf = _block_buffer(weight.shape[1], weight.device)
        for i in range(0, vocab, VOCAB_BLOCK):
            block = buf[: min(VOCAB_BLOCK, vocab - i)]
            block.copy_(weight[i : i + VOCAB_BLOCK])
            out[:, i : i + block.shape[0]] = linear(x, block)
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*h.shape[:-1], weight.shape[0])
