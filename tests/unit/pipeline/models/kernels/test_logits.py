"""pipeline.models.kernels.logits: float32 logits from a low-precision head, a vocabulary block at a time."""

import pytest
import torch
import torch.nn.functional as F

from pipeline.models.kernels import logits
from pipeline.models.kernels.invariant import fixed_linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("linear", [F.linear, fixed_linear], ids=["plain", "invariant"])
def test_blocks_give_the_float32_product_and_reuse_one_buffer(monkeypatch, dtype, linear):
    monkeypatch.setattr(logits, "VOCAB_BLOCK", 16)  # 50 rows: three whole blocks and a partial one
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 24, generator=gen).to(dtype)
    bias = torch.randn(50, generator=gen).to(dtype)
    h = torch.randn(2, 3, 24, generator=gen).to(dtype)
    got = logits.float32_linear(h, weight, bias, linear)
    want = F.linear(h.float(), weight.float(), bias.float())
    assert got.dtype == torch.float32 and got.shape == (2, 3, 50)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    buf = logits._block_buffer(24, weight.device)
    again = logits.float32_linear(h[:1, :1], weight, None, linear)  # one row, no bias
    assert logits._block_buffer(24, weight.device).data_ptr() == buf.data_ptr()
    torch.testing.assert_close(again, F.linear(h[:1, :1].float(), weight.float()), atol=1e-5, rtol=1e-5)
