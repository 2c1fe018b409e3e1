"""--quantize int8: the int8 kernels against the fake-quantized float product, a quantized stage
against HF with fake-quantized weights (its plain reference) and against float32, what a quantized
stage reads, runs at P = 1 and 2, and the combinations refused before loading.

The end-to-end model has peaked distributions by construction: the head is a permutation of the
embedding table (each token strongly predicts one next token) and the layers' output projections
are scaled down, so the float32 top-1 leads the second token by more than 1.2 at every position
used here, while int8 moves a logit by about 0.02. Argmax agreement then holds on any CPU; the
tests check that premise instead of assuming it.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from pipeline.loading.stage_weights import build_stage
from pipeline.models.kernels import int8, native
from pipeline.models.kernels.int8 import (
    eager_quantize_tokens,
    quantize_tokens,
    Int8Linear,
    choose_kernels,
    fake_quantize,
    onednn_prepack,
    quantize_rows,
)
from pipeline.config.options import RunOptions, UsageError, check_options, parse_options
from pipeline.config.plan import make_plan
from tests.utils import llama_stage_tensors, chain_logits, save_hf_model

def _onednn_int8() -> bool:
    try:
        onednn_prepack(torch.ones(2, 4, dtype=torch.int8))
        return True
    except (RuntimeError, AttributeError):
        return False


ONEDNN = _onednn_int8()
needs_onednn = pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN int8 linear")
LOGIT_TOL = 0.1  # int8 vs float32, largest |logit| or |logprob| change allowed (measured ~0.02)
PROMPTS = [[1, *range(2 + 17 * i, 22 + 23 * i)] for i in range(4)]  # BOS, then the special and plain tokens


@pytest.fixture(scope="module")
def peaked(make_llama, tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_llama(num_hidden_layers=2)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.3)
            layer.mlp.down_proj.weight.mul_(0.3)
        e = model.model.embed_tokens.weight
        zero = e.abs().sum(1) == 0  # HF zeroes the pad token's row: give it a direction of its own too
        e[zero] = torch.randn(int(zero.sum()), e.shape[1], generator=torch.Generator().manual_seed(1)) * e.std()
        perm = torch.randperm(e.shape[0], generator=torch.Generator().manual_seed(0))
        model.lm_head.weight.copy_(e[perm] / (8 * e.pow(2).mean().sqrt()))
    return save_hf_model(model, tmp_path_factory.mktemp("peaked"))


def test_rows_round_to_their_scale():
    w = torch.randn(48, 40, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.01, 3, 48)[:, None]
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert int(q.abs().max(dim=1).values.min()) == 127  # each row's largest weight maps to +-127
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] * 0.5 * (1 + 1e-5)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_round_to_the_nearest_step_of_their_row(dtype):
    """Per-token activation quantization: each row's largest value maps to +-127, every value lands
    within half a step, the uint8 form is the int8 values + 128, an all-zero row stays zero."""
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * torch.tensor([0.01, 1, 5, 300, 1, 0])[:, None]
    x = x.to(dtype)
    q, scale = quantize_tokens(x)
    u, scale_u = quantize_tokens(x, unsigned=True)
    assert q.dtype == torch.int8 and u.dtype == torch.uint8 and scale.shape == (6, 1) and scale.dtype == torch.float32
    assert torch.equal(u.int() - 128, q.int()) and torch.equal(scale, scale_u)
    assert q[:5].abs().amax(1).tolist() == [127] * 5 and q[5].abs().max() == 0 and torch.isfinite(scale).all()
    xf = x.float()
    assert ((q.float() * scale - xf).abs() <= scale * 0.5 * (1 + 1e-5)).all()
    assert (q.float() - torch.round(xf / scale)).abs().max() <= 1  # ties may round either way

needs_native = pytest.mark.skipif(native.library() is None, reason="no C compiler: the eager operators run instead")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_native_quantization_is_the_eager_one_bit_for_bit(dtype, rows):
    """The C pass computes exactly the eager operators' values and scales: rows of every magnitude
    (an all-zero row, a row of one huge value, values that land on a rounding tie), a row view with
    a stride (the halves of a fused projection), widths that are not a multiple of the vector size."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * 131 + 6, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x[0, :5] = torch.tensor([127.0, 0.5, -0.5, 1.5, -127.0])  # ties of x / scale + 128 (scale 1)
    if rows > 1:
        x[1] = 0
    if rows > 2:
        x[2] = 0
        x[2, 3] = -3e38
    x = x.to(dtype)
    for view in (x, x[:, 131 : 2 * 131]):  # contiguous, and a strided row view
        assert native.usable(view)
        for unsigned in (True, False):
            q, s = quantize_tokens(view, unsigned)
            q0, s0 = eager_quantize_tokens(view, unsigned)
            assert q.dtype == q0.dtype and torch.equal(q, q0) and torch.equal(s, s0)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_row_scaling_is_the_eager_one(dtype):
    """The products' epilogue in one pass (weight scales, row scales, bias): bit for bit the eager
    operators in the same order."""
    g = torch.Generator().manual_seed(4)
    acc, s, bias = torch.randn(9, 70, generator=g) * 1e3, torch.rand(9, 1, generator=g), torch.randn(70, generator=g)
    w = torch.rand(70, generator=g) * 1e-2
    got = native.scale_rows(acc.clone(), s, None, dtype)
    assert got.dtype == dtype and torch.equal(got, (acc * s).to(dtype))
    assert torch.equal(native.scale_rows(acc.clone(), s, bias, dtype, w), (acc * w * s + bias).to(dtype))
    assert torch.equal(native.scale_rows(acc.clone(), s, None, dtype, w), (acc * w * s).to(dtype))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_prologues_quantize_what_the_eager_operators_compute(dtype):
    """RMSNorm (weight, eps) and SiLU(gate) * up computed inside the quantizing pass: the same values
    and scales as the eager operators followed by the quantization, to float rounding (a value may
    land one step over when it sits on a rounding boundary)."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(9, 2 * 96, generator=g) * torch.logspace(-2, 2, 9)[:, None]).to(dtype)
    w, eps = torch.rand(96, generator=g) + 0.5, 1e-5
    xf = x.float()
    normed = xf[:, :96] * torch.rsqrt(xf[:, :96].pow(2).mean(-1, keepdim=True) + eps) * w
    for prologue, inp, ref, weight in (("rms", x[:, :96], normed, w), ("silu_gate", x, F.silu(xf[:, :96]) * xf[:, 96:], None)):
        u, s = native.quantize_rows_u8_fused(inp, prologue, weight, eps)
        u0, s0 = eager_quantize_tokens(ref, unsigned=True)
        torch.testing.assert_close(s, s0, rtol=1e-5, atol=0)
        assert (u.int() - u0.int()).abs().max() <= 1


@needs_native
@needs_onednn
def test_fused_prologues_leave_the_stage_outputs_unchanged(peaked):
    """fuse_prologues on a stage with oneDNN int8 products: both norms and the gated activation of each
    layer move into the quantization (three projections a layer), the norms stay parameters, and the
    logits equal the unfused stage's to float rounding."""
    from pipeline.models.kernels.int8 import DeferredNorm, fuse_prologues

    model = build_stage(peaked, 0, 2, True, True, quantize="int8")[0]
    for m in model.modules():
        if isinstance(m, Int8Linear):
            m.set_kernel("onednn")
    before, params = chain_logits([model], PROMPTS), len(list(model.parameters()))
    assert fuse_prologues(model) == 3 * len(model.layers)
    assert all(isinstance(b.n1, DeferredNorm) and isinstance(b.n2, DeferredNorm) for b in model.layers)
    assert len(list(model.parameters())) == params
    for x, ref in zip(chain_logits([model], PROMPTS), before, strict=True):
        torch.testing.assert_close(x, ref, atol=2e-3, rtol=1e-3)  # a value one int8 step over, at most


def test_without_a_compiler_the_eager_operators_run(tmp_path, monkeypatch, caplog):
    """A failed build is logged once and the int8 path runs on eager operators, with the same results."""
    monkeypatch.setenv("DIST_INFER_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    native.library.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert native.library() is None and not native.usable(torch.ones(2, 3))
        assert "could not build the native CPU loops" in caplog.text
        x = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
        q, s = quantize_tokens(x)
        q0, s0 = eager_quantize_tokens(x)
        assert torch.equal(q, q0) and torch.equal(s, s0)
        monkeypatch.setenv("CC", "cc")
        monkeypatch.setenv("DIST_RUNNER_NATIVE", "0")
        native.library.cache_clear()
        assert native.library() is None  # turned off
    finally:
        native.library.cache_clear()
        native.decode_dtypes.cache_clear()


@needs_native
def test_a_compiler_without_openmp_keeps_the_loops_but_not_decode_attention(tmp_path, monkeypatch):
    """A compiler that refuses -fopenmp: the loops are built again without it (int8's helpers still
    run), and decode attention stays with PyTorch's kernels."""
    cc = tmp_path / "cc-no-openmp"
    cc.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = "-fopenmp" ] && { echo "no OpenMP here" >&2; exit 1; }; done\n'
                  'exec cc "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("DIST_INFER_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(cc))
    native.library.cache_clear()
    native.decode_dtypes.cache_clear()
    try:
        lib = native.library()
        assert lib is not None and lib.has_openmp() == 0 and native.decode_dtypes() == ()
        x = torch.randn(3, 40, generator=torch.Generator().manual_seed(6))
        assert all(torch.equal(a, b) for a, b in zip(quantize_tokens(x), eager_quantize_tokens(x), strict=True))
    finally:
        native.library.cache_clear()
        native.decode_dtypes.cache_clear()


def _kernels(*widths: int) -> list[str]:
    """The kernels offered on this machine (oneDNN's only where it has the op and its product is exact;
    the C loops' where they have a path for every input width of ``widths``)."""
    return [k for k in int8.KERNELS if (k != "onednn" or (ONEDNN and not int8.onednn_saturates()))
            and (k != "native" or all(native.int8_products_path(w) for w in widths or (64,)))]


def _with_kernel(lin: Int8Linear, kernel: str) -> Int8Linear:
    """A copy of ``lin`` on ``kernel`` (oneDNN's packing frees the plain weight: the original keeps it)."""
    other = Int8Linear(lin.in_features, lin.out_features, lin.bias is not None)
    other.load_state_dict(lin.state_dict())
    other.set_kernel(kernel)
    return other


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [40, 1024, 2500])  # one exact float piece, exactly one, three (dequantize)
def test_every_kernel_gives_the_same_bits(bias, dtype, k):
    """Each kernel forced in turn on the same weights and rows (a decode row, a batch, a prefill-sized
    block; large rows whose int32 sums pass 2^24): bit-identical outputs, so the kernel the timing
    picks can never change an answer; all within the activation rounding of the fake-quantized
    float product (the plain reference)."""
    g = torch.Generator().manual_seed(k)
    w, b = torch.randn(24, k, generator=g), torch.randn(24, generator=g)
    w[:4] = torch.rand(4, k, generator=g) * 0.3 + 1  # rows of one sign: with x > 0, sums past 2^24 at k = 2500
    lin = Int8Linear(k, 24, bias)
    lin.load_float(w)
    if bias:
        lin.bias.data.copy_(b)
    lin = lin.to(dtype)
    big = torch.rand(2, k, generator=g) * 0.1 + 1
    for x in (torch.randn(1, k, generator=g), torch.randn(3, 5, k, generator=g) * 30, torch.randn(300, k, generator=g), big):
        x = x.to(dtype)
        outs = {kernel: _with_kernel(lin, kernel)(x) for kernel in _kernels(k)}
        first = outs["int8"]
        assert first.dtype == dtype and first.shape == (*x.shape[:-1], 24)
        assert all(torch.equal(y, first) for y in outs.values()), {kk: (y - first).abs().max() for kk, y in outs.items()}
        ref = F.linear(x.float(), fake_quantize(w), b if bias else None)
        # per-token activation rounding moves x by at most half its row scale per element: bound the change
        step = x.float().abs().amax(-1, keepdim=True) / 127 / 2
        bound = step * fake_quantize(w).abs().sum(1) + (1e-4 if dtype == torch.float32 else 1e-2 * ref.abs())
        assert ((first.float() - ref).abs() <= bound).all()
    xq, _ = quantize_tokens(big.to(dtype))
    assert (torch._int_mm(xq, lin.weight.t()).abs().max() > 2**24) == (k > 2048)  # past float32's exact integers


def test_a_kernel_that_would_not_give_the_same_bits_is_not_offered(monkeypatch):
    """Where oneDNN's u8 x s8 product saturates (no VNNI / AMX) the ``onednn`` kernel is refused and
    the choice is between the exact ones."""
    monkeypatch.setattr(int8, "onednn_saturates", lambda: True)
    lin = Int8Linear(64, 32, False)
    lin.load_float(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="saturates"):
        lin.set_kernel("onednn")
    chosen = choose_kernels(torch.nn.Sequential(lin), torch.float32, rows=(4, 16))
    assert "onednn" not in chosen["64x32"]["ms"] and lin.kernel in ("int8", "dequantize", "native")


@needs_onednn
def test_onednn_products_are_exact_where_it_is_offered():
    """Rows at +-max against weights of 100-127 of one sign per output: every u8 x s8 pair sum is past
    int16 (what oneDNN's kernel saturates on CPUs without VNNI / AMX). Where the probe finds no
    saturation oneDNN's sums are exact (the int32 products' bits); where it finds it, the plain u8 x s8
    product really is wrong there and the kernel is not offered."""
    g = torch.Generator().manual_seed(7)
    w = (torch.rand(24, 64, generator=g) * 27 + 100) * torch.tensor([1.0, -1.0]).repeat(12)[:, None]
    x = (torch.rand(6, 64, generator=g) * 0.05 + 0.95) * torch.tensor([3.0, -2.0, 1.0, -0.5, 7.0, -1.0])[:, None]
    lin = Int8Linear(64, 24, False)
    lin.load_float(w)
    y = _with_kernel(lin, "int8")(x)  # int8 x int8 -> int32: torch._int_mm, exact
    if int8.onednn_saturates():
        packed = int8._prepack(lin.weight)
        u, _ = quantize_tokens(x, unsigned=True)
        assert (int8._qlinear(u, 128, packed, 24) - torch._int_mm(u.bitwise_xor(128).view(torch.int8),
                                                                    lin.weight.t()).float()).abs().max() > 1
        return
    onednn = _with_kernel(lin, "onednn")
    assert onednn.weight.numel() == 0 and onednn.packed is not None  # the packed copy replaced the plain one
    assert torch.equal(onednn(x), y) and torch.equal(onednn(x[:1]), y[:1])
    with pytest.raises(ValueError, match="packed"):
        onednn.set_kernel("dequantize")


def test_choose_kernels_times_each_shape_and_keeps_the_faster(monkeypatch):
    """The median of interleaved timings decides; a kernel over 3x slower than the fastest at one size
    is not timed at the next (timings faked: kernel speeds by name)."""
    model = torch.nn.Sequential(Int8Linear(32, 64, False), Int8Linear(32, 64, False), Int8Linear(64, 32, True))
    for m in model:
        m.load_float(torch.randn(m.out_features, m.in_features))
        if m.bias is not None:
            m.bias.data.zero_()
    speeds = {"int8": 1.0, "onednn": 0.5, "dequantize": 4.0, "native": 0.7}
    monkeypatch.setattr(int8, "median_times", lambda fns, **_: {k: speeds[k] * 1e-3 for k in fns})
    chosen = choose_kernels(model, torch.float32, rows=(4, 16))
    assert set(chosen) == {"32x64", "64x32"}
    best = "onednn" if "onednn" in _kernels(32, 64) else "native" if "native" in _kernels(32, 64) else "int8"
    for shape, c in chosen.items():
        assert c["kernel"] == best and c["rows"] == [4, 16]
        assert c["ms"]["int8"] == [1.0, 1.0] and c["ms"]["dequantize"] == ([4.0] if best == "onednn" else [4.0, 4.0])
        assert c["ms"].get("native", [0.7, 0.7]) == [0.7, 0.7]
    assert model[0].kernel == model[1].kernel == model[2].kernel == best


def test_median_times_interleave_and_take_the_median():
    """Each function is called once to warm up, then once per round in a rotated order; the result is
    each one's median, so a few spoiled rounds do not decide."""
    calls, clock = [], iter([0, 0, 1, 1, 2, 2, 3, 3, 100, 100, 101, 101, 102, 102])
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    import pipeline.models.kernels.int8 as mod

    real = mod.time.perf_counter
    try:
        mod.time.perf_counter = lambda: next(clock)
        got = mod.median_times(fns, rounds=3, budget_s=1e9)
    finally:
        mod.time.perf_counter = real
    assert calls[:2] == ["a", "b"] and calls[2:] == ["a", "b", "b", "a", "a", "b"]
    assert got == {"a": 1, "b": 1}  # a's 97-second round (a busy neighbour) is outvoted


@pytest.mark.parametrize("ranges", [[(0, 2)], [(0, 1), (1, 2)]])  # P = 1 and P = 2
def test_stage_against_fake_quantized_hf_and_float32(peaked, ranges):
    """Each kernel forced on every projection of the stages, as the runner loads them (fused prologues
    where the C loops build): the same logits bit for bit whichever kernel runs, within int8's
    rounding of HF with the fake-quantized weights and of float32, the same first choices."""
    from transformers import AutoModelForCausalLM
    from pipeline.models.kernels.int8 import fuse_prologues

    n = len(ranges)
    make = lambda q: [build_stage(peaked, a, b, i == 0, i == n - 1, quantize=q)[0] for i, (a, b) in enumerate(ranges)]
    full, by_kernel = chain_logits(make(None), PROMPTS), {}
    for kernel in _kernels(64, 128):
        int8s = make("int8")
        for stage in int8s:
            for m in stage.modules():
                if isinstance(m, Int8Linear):
                    m.set_kernel(kernel)
            fuse_prologues(stage)
        by_kernel[kernel] = chain_logits(int8s, PROMPTS)
    ours = by_kernel["int8"]
    for kernel, logits in by_kernel.items():
        assert all(torch.equal(a, b) for a, b in zip(logits, ours, strict=True)), kernel
    hf = AutoModelForCausalLM.from_pretrained(peaked, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, mod in hf.model.layers.named_modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(fake_quantize(mod.weight))
        for prompt, x, f in zip(PROMPTS, ours, full, strict=True):
            ref = hf(torch.tensor([prompt])).logits[0]
            assert (x - ref).abs().max() < LOGIT_TOL
            top2 = f.topk(2, dim=-1).values
            assert (top2[:, 0] - top2[:, 1]).min() > 2 * LOGIT_TOL + 1  # the premise: no near-tie anywhere
            assert (x - f).abs().max() < LOGIT_TOL
            assert torch.equal(x.argmax(-1), f.argmax(-1))


@pytest.mark.parametrize("first_last", [(False, False), (True, False), (False, True)])
def test_quantized_stage_reads_only_its_tensors(peaked, first_last):
    has_embed, has_head = first_last
    model, store = build_stage(peaked, 1, 2, has_embed, has_head, quantize="int8")
    assert sorted(store.loaded) == sorted(llama_stage_tensors(1, has_embed, has_head))
    layer = model.layers[0]
    for lin in (layer.attn.qkv, layer.attn.o, layer.mlp.up, layer.mlp.down):
        assert isinstance(lin, Int8Linear) and lin.weight.dtype == torch.int8 and lin.scale.dtype == torch.float32
    assert [p.dtype for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n
            and not n.startswith("layers.")] == [torch.float32] * (has_embed + has_head)  # embedding, head: float


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_compute_keeps_float32_scales(peaked, dtype):
    model, _ = build_stage(peaked, 0, 2, True, True, dtype=dtype, quantize="int8")
    qkv = model.layers[0].attn.qkv
    assert qkv.weight.dtype == torch.int8 and qkv.scale.dtype == torch.float32
    assert model.embed.weight.dtype == dtype
    full = build_stage(peaked, 0, 2, True, True, quantize="int8")[0]  # int8 weights, float32 compute
    for x, ref in zip(chain_logits([model], PROMPTS), chain_logits([full], PROMPTS), strict=True):
        assert (x.float() - ref).abs().max() < 0.5  # half-precision activations: 0.024 (bfloat16) measured
        assert torch.equal(x.argmax(-1), ref.argmax(-1))  # margins > 1.2 (see the float32 test)


@pytest.mark.parametrize("ranges", [[(0, 2)], [(0, 1), (1, 2)]])  # P = 1 and P = 2
def test_bfloat16_stages_against_float32(peaked, ranges):
    """--dtype bfloat16 (its projections on oneDNN's packed bf16 kernel where the CPU has bf16
    instructions, as the runner loads them) against float32 on the peaked model: logits within bf16's
    rounding of activations and weights, the same first choice everywhere."""
    from pipeline.models.kernels.packed import pack_stage

    n = len(ranges)
    chains = {}
    for dtype in (torch.float32, torch.bfloat16):
        chains[dtype] = [build_stage(peaked, a, b, i == 0, i == n - 1, dtype=dtype)[0] for i, (a, b) in enumerate(ranges)]
        for stage in chains[dtype]:
            pack_stage(stage, torch.device("cpu"), dtype)
    for x, f in zip(chain_logits(chains[torch.bfloat16], PROMPTS), chain_logits(chains[torch.float32], PROMPTS), strict=True):
        assert x.dtype == torch.float32  # the head's logits stay float32 in a bf16 stage
        assert (x - f).abs().max() < 0.5  # bf16 activations and weights (8-bit mantissas): 0.023 measured
        assert torch.equal(x.argmax(-1), f.argmax(-1))  # the float32 top-1 leads by > 1.2 (see above)


def test_unsupported_combinations_fail_before_loading(peaked, tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    problems = check_options(RunOptions(quantize="int8", lora=[f"a={adapter}"]))
    assert any("--quantize int8 does not apply LoRA adapters" in p for p in problems)
    assert any("--batch-invariant" in p for p in check_options(RunOptions(quantize="int8", batch_invariant=True)))
    assert any("--backend transformers" in p for p in check_options(RunOptions(quantize="int8", backend="transformers")))
    with pytest.raises(SystemExit):
        parse_options(["--quantize", "int4"])
    opts = RunOptions(model_name=peaked, quantize="int8", backend="transformers")  # past the flag check
    with pytest.raises(UsageError, match="--quantize int8 needs a native family"):
        make_plan(opts, env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}, cpu_count=1)


def test_plan_names_the_precision(peaked):
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    plain = make_plan(parse_options(["--model-name", peaked]), env=env, cpu_count=1)
    quant = make_plan(parse_options(["--model-name", peaked, "--quantize", "int8"]), env=env, cpu_count=1)
    assert "quantize" not in plain.fingerprint and quant.fingerprint["quantize"] == "int8"
    assert quant.model_name == plain.model_name + ":int8"


def test_stage_memory_costs_int8_layers_at_a_byte_per_weight(peaked):
    from pipeline.loading.stage_weights import read_config
    from pipeline.models.families import spec_from_config
    from pipeline.config.sizing import model_costs

    cfg = read_config(peaked)
    spec = spec_from_config(cfg)
    floats, f_first, f_last = model_costs(cfg, spec, None, torch.float32, 0)
    int8s, q_first, q_last = model_costs(cfg, spec, None, torch.float32, 0, int8=True)
    h, i = spec.hidden_size, spec.intermediate_size  # 64, 128; no biases, two RMSNorm weights
    proj = {(h, 3 * h), (h, h), (h, 2 * i), (i, h)}  # (in, out) of qkv, o, gate+up, down
    assert floats[0] == 4 * (sum(a * b for a, b in proj) + 2 * h)
    assert int8s[0] == sum(a * b + 4 * b for a, b in proj) + 4 * 2 * h
    assert (q_first, q_last) == (f_first, f_last)  # embedding and head stay in the run's dtype


def test_loading_quantizes_each_stored_tensor_into_its_rows(peaked, monkeypatch):
    """Fused projections (q/k/v, gate/up) are quantized stored tensor by stored tensor, a block of rows at
    a time, into their rows: the same int8 values and scales as quantizing the fused float weight whole;
    a stored tensor of the wrong shape is an error naming it."""
    from safetensors.torch import load_file
    from pipeline.loading.tensor_store import CheckpointError
    from pipeline.models.kernels import int8 as int8_module

    monkeypatch.setattr(int8_module, "QUANTIZE_ROWS", 7)  # blocks that do not divide the rows
    model, _ = build_stage(peaked, 0, 2, True, True, quantize="int8")
    stored = load_file(f"{peaked}/model.safetensors")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for lin, names in ((layer.attn.qkv, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                           (layer.mlp.up, ["mlp.gate_proj", "mlp.up_proj"]), (layer.mlp.down, ["mlp.down_proj"])):
            q, scale = quantize_rows(torch.cat([stored[p + n + ".weight"] for n in names]))
            assert torch.equal(lin.weight, q) and torch.equal(lin.scale, scale)
    import shutil
    from pathlib import Path
    from safetensors.torch import save_file

    bad = Path(peaked).parent / "peaked-bad"
    shutil.copytree(peaked, bad, dirs_exist_ok=True)
    stored["model.layers.1.mlp.up_proj.weight"] = stored["model.layers.1.mlp.up_proj.weight"][:, :-1].contiguous()
    save_file(stored, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="mlp.up_proj.weight"):
        build_stage(str(bad), 0, 2, True, True, quantize="int8")


@pytest.fixture(params=["this CPU's", "AVX2"])
def int8_build(request):
    """The loops this CPU's build has, and the AVX2 build's (VNNI off)."""
    if request.param == "AVX2":
        request.getfixturevalue("avx2_loops")


@needs_native
@pytest.mark.parametrize("rows, k, n", [(1, 64, 16), (3, 128, 33), (13, 64, 7), (8, 1088, 50), (17, 4096, 20),
                                        (5, 48, 9), (2, 80, 4)])
def test_native_int8_products_are_the_exact_integer_sums(int8_build, rows, k, n):
    """Both C loops (AVX512-VNNI on the 16-output layout, AVX2 on the plain weight), where this CPU's
    build has them, and the AVX2 build's: the exact sums of (u - 128) x w at every row count (blocks of 8,
    4, 2, 1 rows), output count (partial blocks) and width (a last step of 16 in the AVX2 loop), extremes
    included (u 0 and 255 against weights of +-127, the quantizer's range)."""
    g = torch.Generator().manual_seed(rows * k + n)
    u = torch.randint(0, 256, (rows, k), dtype=torch.uint8, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    u[0], w[0] = 255, 127  # every product at its largest
    if rows > 1:
        u[1], w[-1] = 0, -127  # and at its most negative
    exact = (u.long() - 128) @ w.long().t()
    paths = 0
    if native.int8_products_path(k) == "vnni":
        got = native.int8_products_vnni(u, native.pack_vnni(w), n, w.sum(1, dtype=torch.int32))
        assert torch.equal(got.long(), exact)
        paths += 1
    if native.library().int8_products_path(k):
        assert torch.equal(native.int8_products(u, w).long(), exact)
        paths += 1
    assert paths or native.int8_products_path(k) is None
