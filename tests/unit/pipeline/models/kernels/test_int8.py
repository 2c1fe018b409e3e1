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
    """The product's per-row rescale (and bias) in one pass: bit for bit without a bias, to float32
    rounding with one (the eager ``addcmul`` may fuse its multiply-add)."""
    g = torch.Generator().manual_seed(4)
    acc, s, bias = torch.randn(9, 70, generator=g) * 1e3, torch.rand(9, 1, generator=g), torch.randn(70, generator=g)
    got = native.scale_rows(acc.clone(), s, None, dtype)
    assert got.dtype == dtype and torch.equal(got, (acc * s).to(dtype))
    torch.testing.assert_close(native.scale_rows(acc.clone(), s, bias, dtype), torch.addcmul(bias, acc, s).to(dtype),
                               rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-3)


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


@pytest.mark.parametrize("bias", [False, True])
def test_kernels_against_the_fake_quantized_product(bias):
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    x = torch.randn(3, 5, 40, generator=g)
    lin = Int8Linear(40, 24, bias)
    lin.load_float(w)
    if bias:
        lin.bias.data.copy_(b)
    ref = F.linear(x, fake_quantize(w), b if bias else None)  # the plain reference
    lin.kernel = "dequantize"
    torch.testing.assert_close(lin(x), ref, atol=1e-5, rtol=1e-5)
    lin.kernel = "int8"
    # per-token activation rounding moves x by at most half its row scale per element: bound the change
    step = x.abs().amax(-1, keepdim=True) / 127 / 2  # (3, 5, 1)
    bound = step * fake_quantize(w).abs().sum(1) + 1e-4
    y = lin(x)
    assert ((y - ref).abs() <= bound).all()
    assert (y - ref).abs().max() > 0  # really the int8 path, not a float product
    if ONEDNN:  # the same integer products against oneDNN's packed weights: only the scales' rounding differs
        lin.set_kernel("onednn")
        assert lin.weight.numel() == 0 and lin.packed is not None  # the packed copy replaced the plain one
        torch.testing.assert_close(lin(x), y, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(lin(x[0, :1]), y[0, :1], atol=1e-4, rtol=1e-5)  # one row (decode)
        with pytest.raises(ValueError, match="packed"):
            lin.set_kernel("dequantize")


@needs_onednn
@pytest.mark.parametrize("split", [False, True])
def test_onednn_products_stay_exact_where_int16_pair_sums_would_saturate(split, monkeypatch):
    """Rows at +-max against weights of 100-127 of one sign per output: every u8 x s8 pair sum is
    past int16 (what oneDNN's kernel saturates on CPUs without VNNI / AMX). The product split in two
    halves (forced here on any CPU) is exact everywhere; the single product only where the probe
    finds no saturation, and where it does find it, the single product really is wrong there."""
    g = torch.Generator().manual_seed(7)
    w = (torch.rand(24, 64, generator=g) * 27 + 100) * torch.tensor([1.0, -1.0]).repeat(12)[:, None]
    x = (torch.rand(6, 64, generator=g) * 0.05 + 0.95) * torch.tensor([3.0, -2.0, 1.0, -0.5, 7.0, -1.0])[:, None]
    lin = Int8Linear(64, 24, False)
    lin.load_float(w)
    lin.kernel = "int8"
    y = lin(x)  # int8 x int8 -> int32: torch._int_mm, exact
    lin.set_kernel("onednn")
    saturates = int8.onednn_saturates()
    monkeypatch.setattr(int8, "onednn_saturates", lambda: split)
    if split or not saturates:
        torch.testing.assert_close(lin(x), y, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(lin(x[:1]), y[:1], atol=1e-4, rtol=1e-5)  # one row (decode)
    else:
        assert (lin(x) - y).abs().max() > 1  # what the probe found: the plain u8 x s8 product loses sums here


def test_choose_kernels_times_each_shape_and_keeps_the_faster():
    model = torch.nn.Sequential(Int8Linear(32, 64, False), Int8Linear(32, 64, False), Int8Linear(64, 32, True))
    for m in model:
        m.load_float(torch.randn(m.out_features, m.in_features))
        if m.bias is not None:
            m.bias.data.zero_()
    chosen = choose_kernels(model, torch.float32, rows=(4, 16))
    assert set(chosen) == {"32x64", "64x32"}
    for shape, c in chosen.items():
        assert c["kernel"] in c["ms"] and all(len(v) >= 1 for v in c["ms"].values())
        timed = {k: v for k, v in c["ms"].items() if len(v) == 2}  # not dropped after the first size
        last = min(v[-1] for v in timed.values())  # a kernel over 3x slower at the last size is out too
        fastest = min(sum(v) for v in timed.values() if v[-1] <= 3 * last)
        assert sum(c["ms"][c["kernel"]]) == fastest
    assert model[0].kernel == model[1].kernel == chosen["32x64"]["kernel"]


@pytest.mark.parametrize("ranges", [[(0, 2)], [(0, 1), (1, 2)]])  # P = 1 and P = 2
@pytest.mark.parametrize("kernel", ["dequantize", "int8", pytest.param("onednn", marks=needs_onednn)])
def test_stage_against_fake_quantized_hf_and_float32(peaked, ranges, kernel):
    from transformers import AutoModelForCausalLM

    n = len(ranges)
    make = lambda q: [build_stage(peaked, a, b, i == 0, i == n - 1, quantize=q)[0] for i, (a, b) in enumerate(ranges)]
    floats, int8s = make(None), make("int8")
    for stage in int8s:
        for m in stage.modules():
            if isinstance(m, Int8Linear):
                m.set_kernel(kernel)
    ours, full = chain_logits(int8s, PROMPTS), chain_logits(floats, PROMPTS)
    hf = AutoModelForCausalLM.from_pretrained(peaked, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, mod in hf.model.layers.named_modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(fake_quantize(mod.weight))
        for prompt, x, f in zip(PROMPTS, ours, full, strict=True):
            ref = hf(torch.tensor([prompt])).logits[0]
            if kernel == "dequantize":  # the same arithmetic as the plain reference, to float rounding
                torch.testing.assert_close(x, ref, atol=1e-4, rtol=1e-4)
            else:
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
    floats, f_first, f_last = model_costs(cfg, spec, None, "auto", torch.float32, 0)
    int8s, q_first, q_last = model_costs(cfg, spec, None, "auto", torch.float32, 0, int8=True)
    h, i = spec.hidden_size, spec.intermediate_size  # 64, 128; no biases, two RMSNorm weights
    proj = {(h, 3 * h), (h, h), (h, 2 * i), (i, h)}  # (in, out) of qkv, o, gate+up, down
    assert floats[0] == 4 * (sum(a * b for a, b in proj) + 2 * h)
    assert int8s[0] == sum(a * b + 4 * b for a, b in proj) + 4 * 2 * h
    assert (q_first, q_last) == (f_first, f_last)  # embedding and head stay in the run's dtype
