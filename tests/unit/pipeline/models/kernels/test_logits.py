"""pipeline.models.kernels.logits: float32 logits from a low-precision head, a vocabulary block at a time."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

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


def _native_head_or_skip(x, weight):
    from pipeline.models.kernels import native

    if not native.bf16_usable(x, weight):
        pytest.skip("no native bfloat16 loop here (needs a C compiler with OpenMP and AVX512-BF16 or AVX2)")
    return native


@pytest.fixture(params=["this CPU's", "AVX2"])
def bf16_loop(request):
    """The loop this CPU's build runs (AVX512-BF16 where it has it), and the AVX2 one."""
    if request.param == "AVX2":
        request.getfixturevalue("avx2_loops")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 131])  # 131: past a chunk of 128 rows (AVX2)
def test_the_native_bf16_head_gives_the_float32_product_whatever_the_rows_beside_and_the_threads(bf16_loop, rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(1003, 96, generator=gen).bfloat16()  # vocabulary: not a multiple of a tile
    bias = torch.randn(1003, generator=gen).bfloat16()
    h = torch.randn(rows, 96, generator=gen).bfloat16()
    native = _native_head_or_skip(h, weight)
    got = logits.float32_linear(h, weight, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, 1003)
    want = (h.double() @ weight.double().t() + bias.double()).float()  # exact products, float32 rounding only
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    alone = torch.cat([native.bf16_products(h[i : i + 1], weight) for i in range(rows)])
    assert torch.equal(alone, native.bf16_products(h, weight))  # a row's logits: not its micro-batch's
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native.bf16_products(h, weight), alone)
    finally:
        torch.set_num_threads(threads)


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # the fixture picks a library: same for all
@given(rows=st.integers(0, 11), vocab=st.integers(1, 300), hidden=st.sampled_from([32, 64, 96, 160]),
       seed=st.integers(0, 2**16))
def test_the_native_bf16_head_on_drawn_shapes(bf16_loop, rows, vocab, hidden, seed):
    """Any rows (none included), any vocabulary (tiles cut anywhere), hidden sizes the loop takes."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, hidden, generator=gen) * 3).bfloat16()
    h = torch.randn(rows, hidden, generator=gen).bfloat16()
    native = _native_head_or_skip(h, weight)
    got = native.bf16_products(h, weight)
    assert got.shape == (rows, vocab) and got.dtype == torch.float32
    torch.testing.assert_close(got, (h.double() @ weight.double().t()).float(), atol=1e-4, rtol=1e-5)
