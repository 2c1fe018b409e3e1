"""The head's matmul with float32 output for any weight dtype.

A bf16/fp16 ``lm_head`` rounds every logit to 8 (or 11) bits before the float32 log-softmax; the
logprobs of bf16 runs would carry that rounding. Here the products accumulate in float32 and the
logits stay float32: on CUDA through ``torch.mm(..., out_dtype=torch.float32)`` (the GEMM accumulates
in float32 anyway; only the output's rounding goes), elsewhere by casting the weight to float32 a
block of vocabulary rows at a time (never a float32 copy of the whole table).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB_BLOCK = 8192  # vocabulary rows cast at a time (CPU, low precision)


def float32_linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   linear=F.linear) -> torch.Tensor:
    """``h @ weight.T + bias`` as float32 logits. h (..., hidden); weight (vocab, hidden). ``linear``:
    the float32 product (batch-invariant stages pass :func:`~.invariant.fixed_linear`)."""
    if weight.dtype == torch.float32:
        return linear(h.float(), weight, bias)
    flat = h.reshape(-1, h.shape[-1])
    if weight.is_cuda and linear is F.linear:
        out = torch.mm(flat, weight.t(), out_dtype=torch.float32)
    else:
        x = flat.float()
        out = torch.cat([linear(x, weight[i : i + VOCAB_BLOCK].float()) for i in range(0, weight.shape[0], VOCAB_BLOCK)],
                        dim=-1)
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*h.shape[:-1], weight.shape[0])
