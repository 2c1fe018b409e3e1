"""What the GPU paths rely on, checked on the CPU: parameters are allocated once, in the run's
dtype (never materialized in float32 and cast); the causal fast path of attention equals the
masked path; the head computes logprobs of bf16 runs from float32 logits."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipeline.loading.stage_weights import build_stage
from tests.utils import save_hf_model


class Allocations(TorchDispatchMode):
    """Every new CPU storage an operation returns: its bytes and dtype."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[int, torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().data_ptr() not in inputs:
                self.storages.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage().nbytes(), t.dtype))
        return out


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.utils import local_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(local_tokenizer()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return save_hf_model(LlamaForCausalLM(cfg).to(torch.bfloat16).eval(), tmp_path_factory.mktemp("bf16"))


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_parameters_are_allocated_once_in_the_run_dtype(bf16_llama, backend):
    with Allocations() as seen:
        model, _ = build_stage(bf16_llama, 0, 2, True, True, torch.bfloat16, "cpu", backend=backend)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    allocated = sum(n for n, _ in seen.storages.values())
    float32 = sum(n for n, dtype in seen.storages.values() if dtype == torch.float32)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # the parameters once, the one-at-a-time temporaries of fused tensors (q/k/v, gate/up) and small
    # tables (rotary, at 32 positions); materializing in float32, then casting, allocates 3x params
    assert allocated < 2 * params, (allocated, params)
    assert float32 < 0.1 * params, (float32, params)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_causal_fast_path_equals_the_masked_path(heads, kv_heads):
    from pipeline.models.kernels.sdpa import attend

    torch.manual_seed(0)
    b, t, d = 3, 7, 16
    q, k, v = torch.randn(b, heads, t, d), torch.randn(b, kv_heads, t, d), torch.randn(b, kv_heads, t, d)
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None].expand(b, 1, t, t)
    g = heads // kv_heads
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=causal, scale=0.3)
    torch.testing.assert_close(attend(q, k, v, None, 0.3), reference)
    torch.testing.assert_close(attend(q, k, v, causal, 0.3), reference)


@pytest.mark.parametrize("alibi", [False, True])
def test_decode_over_per_row_lengths_without_repeating_kv(alibi):
    """One query per row, rows of different lengths, GQA: the folded form equals repeated K/V."""
    from pipeline.models.decoder import alibi_slopes
    from pipeline.models.kernels.sdpa import attend

    torch.manual_seed(0)
    b, h, kvh, kv, d = 3, 8, 2, 9, 16
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, kvh, kv, d), torch.randn(b, kvh, kv, d)
    lens = torch.tensor([9, 4, 1])
    mask = (torch.arange(kv)[None, :] < lens[:, None])[:, None, None, :]  # (b, 1, 1, kv)
    if alibi:
        bias = alibi_slopes(h)[None, :, None, None] * torch.arange(kv).float()
        mask = torch.where(mask, bias, torch.tensor(float("-inf")))  # (b, h, 1, kv)
    g = h // kvh
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(attend(q, k, v, mask, 0.25), reference)


def test_prefill_builds_no_mask_for_a_plain_causal_layout(make_llama):
    """Fresh prompts with full attention take the causal kernel; resumed rows attend row by row, each
    with its own bottom-right causal mask, and no padded mask is built; the stage's output is the same
    either way (HF parity tests check the numbers against transformers)."""
    from pipeline.models.decoder import Segment

    model, _ = build_stage(make_llama(num_hidden_layers=2, num_key_value_heads=2), 0, 2, True, False)
    rows, start = torch.arange(2), torch.zeros(2, dtype=torch.long)
    fresh = Segment(rows, start, 5, 5, fresh=True, prefill=True, lens=[5, 3])
    resumed = Segment(rows, start, 5, 5, fresh=False, prefill=True, lens=[5, 3])
    assert 0 not in model.context(fresh, None, torch.float32).masks
    ctx = model.context(resumed, None, torch.float32)
    assert 0 not in ctx.masks and ctx.runs is None
    assert [views[0][1].shape for _, _, views in ctx.row_keys] == [(1, 1, 5, 5), (1, 1, 3, 3)]
    assert ctx.row_keys[1][2][0][1][0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    ids = torch.randint(0, 100, (2, 5))
    cache = model.new_cache(2, 8)
    with torch.inference_mode():
        a = model(ids, fresh, None)
        b = model(ids, resumed, cache)
    torch.testing.assert_close(a, b)


def test_prefill_of_ragged_prompts_computes_only_their_tokens(make_llama, monkeypatch):
    """Prompts of different lengths share a prefill right-padded to the longest; the projections and
    MLPs run on the real tokens only, and the stage's output at those tokens equals the padded
    computation's (the HF parity tests check the numbers against transformers through this path)."""
    from pipeline.models.kernels import unpad
    from pipeline.models.decoder import Segment

    model, _ = build_stage(make_llama(num_hidden_layers=2, num_key_value_heads=2), 0, 2, True, False)
    lens = [7, 2, 4]
    seg = Segment(torch.arange(3), torch.zeros(3, dtype=torch.long), 7, 7, fresh=True, prefill=True, lens=lens)
    ctx = model.context(seg, None, torch.float32)
    assert ctx.real.tolist() == [*range(0, 7), 7, 8, 14, 15, 16, 17]
    rows, mlp = [], model.layers[0].mlp
    monkeypatch.setattr(mlp, "_mlp", lambda x, *a, _f=mlp._mlp: rows.append(x.shape[:-1].numel()) or _f(x, *a))
    ids = torch.randint(0, 100, (3, 7))
    with torch.inference_mode():
        unpadded = model(ids, seg, model.new_cache(3, 8))
        monkeypatch.setattr(unpad, "UNPAD_ABOVE", 0.0)  # keep the padding
        padded = model(ids, seg, model.new_cache(3, 8))
    assert rows[0] == sum(lens) and rows[1:] == [3 * 7]
    for i, n in enumerate(lens):
        torch.testing.assert_close(unpadded[i, :n], padded[i, :n])
        assert not unpadded[i, n:].any()  # padding positions are zeros, never read


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_bf16_logprobs_come_from_float32_logits(bf16_llama, backend):
    """The head of a bf16 stage equals a float32 head applied to the same (bf16) normed hidden
    states, far closer than bf16 rounding of the logits would allow."""
    from pipeline.sampling.sampler import logprob_info

    model, _ = build_stage(bf16_llama, 2, 2, False, True, torch.bfloat16, "cpu", backend=backend)
    torch.manual_seed(1)
    h = torch.randn(5, 64).bfloat16()
    norm = model.final_norm._norm if backend == "native" else model.norm
    with torch.inference_mode():
        logits = model.head(h)
        reference = norm(h).float() @ model.lm_head.weight.float().t()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    rounded = reference.bfloat16().float()
    assert (rounded - reference).abs().max() > 100 * (logits - reference).abs().max()  # the test can tell
    chosen = logits.argmax(-1)
    torch.testing.assert_close(logprob_info(logits, chosen, 0)[0],
                               torch.log_softmax(reference, -1).gather(-1, chosen[:, None]).flatten())


def test_kv_cell_bytes_and_out_of_memory_advice(bf16_llama):
    """--budget auto divides free memory by this stage's bytes per KV token; an OOM names the flags."""
    from dist_inference_runner import out_of_memory_advice
    from pipeline.config.budget import kv_cell_bytes
    from pipeline.config.options import parse_options

    for backend in ("native", "transformers"):
        model, _ = build_stage(bf16_llama, 0, 2, True, False, torch.bfloat16, "cpu", backend=backend)
        assert kv_cell_bytes(model) == 2 * 2 * (2 * 16) * 2  # k+v x 2 layers x (2 kv heads x 16) x bf16
    advice = out_of_memory_advice(parse_options(["--budget", "4096"]))
    assert "--budget (this run: 4096 tokens)" in advice and "--max-micro-batch-size" in advice


@pytest.mark.parametrize("backend", ["native", "transformers"])
def test_scoring_micro_batches_allocate_no_kv_cache(llama_2l, tmp_path, backend):
    """Echo scoring (max_tokens 0) attends to each prompt's own keys and keeps none: a file of such
    requests never allocates a KV cache (the summary's peak is 0), and its logprobs are HF's; one
    generating request makes its micro-batch allocate one."""
    import json

    from tests.utils import hf_logits, read_jsonl, run_inprocess, write_jsonl

    prompts = [[0, *range(5 + 7 * i, 5 + 7 * i + n)] for i, n in enumerate([9, 3, 17, 6])]
    scoring = [{"prompt": p, "max_tokens": 0, "echo": True, "logprobs": 1} for p in prompts]
    for name, reqs in (("score", scoring), ("mixed", [*scoring, {"prompt": prompts[0], "max_tokens": 3}])):
        out = tmp_path / f"{name}.jsonl"
        args = ["--model-name", llama_2l, "--infer-data", write_jsonl(tmp_path / f"in-{name}.jsonl", reqs),
                "--output-path", str(out), "--no-progress", "--backend", backend]
        assert run_inprocess(args) == 0
        peak = json.loads((tmp_path / f"{name}.jsonl.summary.json").read_text())["kv_cells_peak"]
        assert (peak == 0) if name == "score" else (peak > 0), (name, peak)
        lines = read_jsonl(out)
        assert len(lines) == len(reqs)
        for line, p in zip(lines[: len(prompts)], prompts, strict=True):
            got = line["result"]["choices"][0]["logprobs"]["token_logprobs"][1:]
            want = hf_logits(llama_2l, p).log_softmax(-1)[:-1].gather(1, torch.tensor(p[1:])[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=0)


def test_a_cache_allocated_ahead_is_the_one_its_pass_uses(make_llama):
    """``Allocate`` reaches a rank before the pass that allocates the slot's cache: the rank frees what
    that pass releases and allocates the cache then (while the ranks before it compute), and the pass
    uses that cache, even when the same header releases the slot's old one; a pass asking for other
    dimensions gets its own. The KV cells held count a cache allocated ahead."""
    from pipeline.runtime.messages import Allocate, PassHeader, Prefill
    from pipeline.runtime.stage import Stage

    model, _ = build_stage(make_llama(num_hidden_layers=2, num_key_value_heads=2), 0, 2, True, True)
    stage = Stage(model, torch.device("cpu"))
    stage.step(PassHeader(1, 2, [2, 8], [], [], [], [], [Prefill(0, 0, 3)]), torch.tensor([5, 6, 7]))
    stage.step(PassHeader(2, 2, [2, 8], [], [], [], [], [Prefill(0, 0, 3)]), torch.tensor([5, 6, 7]))
    old = stage.caches[1]
    stage.prepare(Allocate(1, 3, 16, release=[2]))
    ahead = stage.prepared[1][1]
    assert not stage.caches and ahead.rows == 3 and ahead.cols == 16 and stage.kv_cells == 3 * 16
    x = torch.tensor([5, 6, 7, 8])  # one prompt's ids, as pack() sends them
    stage.step(PassHeader(1, 3, [3, 16], [1], [], [], [], [Prefill(0, 0, 4)]), x)  # releases slot 1, allocates it
    assert stage.caches[1] is ahead and stage.caches[1] is not old and not stage.prepared
    assert stage.caches[1].k[:, 0, :, :4].abs().sum() > 0  # the pass wrote its keys there
    stage.prepare(Allocate(1, 2, 8))
    stage.step(PassHeader(1, 3, [3, 16], [], [], [], [], [Prefill(0, 0, 4)]), x)
    assert stage.caches[1].rows == 3 and stage.caches[1].cols == 16 and not stage.prepared


def test_backend_and_device_per_dist_backend():
    """--dist-backend: NCCL on GPUs by default, gloo on CPUs; gloo on GPUs keeps the rank's GPU (ranks may
    then share one: two ranks of one GPU are refused under NCCL only); nccl without GPUs is refused."""
    from comm.dist import choose_backend

    cpu, gpu = torch.device("cpu"), lambda i: torch.device("cuda", i)
    assert choose_backend("auto", 0, None, 1) == (cpu, "gloo")
    assert choose_backend("gloo", 0, None, 1) == (cpu, "gloo")
    assert choose_backend("auto", 2, None, 3) == (gpu(1), "nccl")
    assert choose_backend("gloo", 1, None, 1) == (gpu(0), "gloo")  # two ranks, one GPU: allowed over gloo
    assert choose_backend("nccl", 4, 2, 0) == (gpu(2), "nccl")  # --cuda-id wins
    with pytest.raises(ValueError, match="needs CUDA GPUs"):
        choose_backend("nccl", 0, None, 0)
