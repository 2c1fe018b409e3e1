"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE): HF parity for P = 1, 2, 3, experts
that receive no tokens, both checkpoint layouts of the experts, batch invariance, and echo scoring
end to end through the CLI."""

from pathlib import Path

import pytest
import torch

from pipeline.loading.stage_weights import CheckpointError, build_stage
from pipeline.models.families import spec_from_config
from pipeline.models.moe import SparseMoE
from pipeline.config.partition import stage_ranges
from tests.unit.pipeline.models.kernels.test_invariant import OTHERS, TARGET, _prefill_and_decode, threads  # noqa: F401 (fixture)
from tests.utils import assert_hf_parity, chain_logits, hf_logits, local_tokenizer, save_hf_model, stage_chain

PROMPTS = [[5, 17, 300, 42, 9, 11, 1000, 7, 13], [100, 200], [31, 1020, 8, 99, 900]]  # ids < 1024 (the local vocab)
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)

# name -> (model_type, config overrides); 3 layers, 8 experts, top-2
VARIANTS = {
    "mixtral": ("mixtral", dict(COMMON, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2)),
    # shared expert with its sigmoid gate; layer 1 a dense MLP (mlp_only_layers); routing weights not renormalized
    "qwen2_moe": ("qwen2_moe", dict(COMMON, intermediate_size=128, moe_intermediate_size=48, num_experts=8,
                                    num_experts_per_tok=2, shared_expert_intermediate_size=80, mlp_only_layers=[1],
                                    norm_topk_prob=False)),
    # q/k norm, attention bias, renormalized top-k; decoder_sparse_step=2: only layer 1 routes
    "qwen3_moe": ("qwen3_moe", dict(COMMON, head_dim=16, intermediate_size=128, moe_intermediate_size=48,
                                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
                                    attention_bias=True)),
}


def tiny_moe(out_dir, name: str, seed: int = 0, **extra) -> str:
    """A random 3-layer model of variant ``name`` with the local tokenizer, saved by save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = VARIANTS[name]
    tok = local_tokenizer()
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tok), max_position_embeddings=256, num_hidden_layers=3,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, **{**overrides, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:  # HF zero-inits biases and sets norms to 1
                p.add_(torch.randn_like(p) * 0.1)
            if n.endswith("mlp.gate.weight") or "shared_expert_gate" in n:
                p.mul_(30)  # decisive routing (HF's init makes it near-uniform) and a gate that matters
    return save_hf_model(model, out_dir)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model_dir(request, tmp_path_factory):
    return tiny_moe(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_logits_and_greedy_match_hf(model_dir, stages):
    assert_hf_parity(model_dir, PROMPTS, stages)


def test_variant_specs_and_layer_kinds():
    """Which layers route (decoder_sparse_step, mlp_only_layers) and the per-family switches."""
    specs = {n: spec_from_config(dict(vocab_size=64, num_hidden_layers=4, model_type=t, **o))
             for n, (t, o) in VARIANTS.items()}
    kinds = {n: [s.moe.sparse(i) for i in range(4)] for n, s in specs.items()}
    assert kinds == {"mixtral": [True] * 4, "qwen2_moe": [True, False, True, True],
                     "qwen3_moe": [False, True, False, True]}
    mx, q2, q3 = specs["mixtral"].moe, specs["qwen2_moe"].moe, specs["qwen3_moe"].moe
    assert (mx.num_experts, mx.top_k, mx.expert_size, mx.norm_topk_prob, mx.fp32_weights) == (8, 2, 96, True, True)
    assert (q2.shared_expert_size, q2.norm_topk_prob, specs["qwen2_moe"].qkv_bias) == (80, False, True)
    assert (q3.shared_expert_size, q3.norm_topk_prob, specs["qwen3_moe"].qk_norm) == (0, True, "head")
    # transformers 4 configs spell the expert count num_experts (Qwen) / num_local_experts (Mixtral)
    legacy = spec_from_config(dict(vocab_size=64, num_hidden_layers=2, model_type="qwen3_moe", num_local_experts=4,
                                   **{k: v for k, v in VARIANTS["qwen3_moe"][1].items() if k != "num_experts"}))
    assert legacy.moe.num_experts == 4
    dense = spec_from_config(dict(vocab_size=64, num_hidden_layers=2, model_type="qwen2_moe", **COMMON,
                                  intermediate_size=32, num_experts=0))
    assert dense.moe is None and dense.qkv_bias
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        spec_from_config(dict(vocab_size=64, num_hidden_layers=2, model_type="mixtral", **COMMON,
                              intermediate_size=32, num_local_experts=2, num_experts_per_tok=3))


def test_stage_holds_only_its_layers_experts(tmp_path):
    d = tiny_moe(tmp_path / "q2", "qwen2_moe")
    model, _ = build_stage(d, 1, 3, False, False)
    assert [type(b.mlp).__name__ for b in model.layers] == ["MLP", "SparseMoE"]
    assert model.layers[1].mlp.gate_up.shape == (8, 96, 64) and model.layers[1].mlp.shared is not None


def _reference_experts(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: the definition the grouped computation must equal."""
    w, idx = moe.route(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.moe.top_k):
            e = int(idx[t, j])
            gate, up = (moe.gate_up[e] @ x[t]).chunk(2)
            out[t] += w[t, j] * (moe.down[e] @ (moe.act(gate) * up))
    return out


@pytest.mark.parametrize("tile", [0, 16])
def test_grouped_experts_equal_per_token_loop_with_empty_experts(tile):
    spec = spec_from_config(dict(vocab_size=64, num_hidden_layers=1, model_type="mixtral", **COMMON,
                                 intermediate_size=32, num_local_experts=8, num_experts_per_tok=2))
    torch.manual_seed(0)
    moe = SparseMoE(spec, tile)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        moe.router.weight[5:] = -moe.router.weight[:3].abs().sum(0) * 100  # experts 5..7: never chosen for x > 0
    x = torch.rand(7, 64) + 0.1
    used = torch.bincount(moe.route(x)[1].reshape(-1), minlength=8)
    assert (used[5:] == 0).all() and used.sum() == 14
    torch.testing.assert_close(moe(x), _reference_experts(moe, x), atol=1e-5, rtol=1e-5)
    one = moe(x[:1])  # a single token (decode step): 6 of 8 experts idle
    torch.testing.assert_close(one, _reference_experts(moe, x[:1]), atol=1e-5, rtol=1e-5)


def test_experts_receiving_no_tokens_in_a_pass(tmp_path, monkeypatch):
    """A 2-token prompt alone reaches at most 4 of 8 experts per layer (1 token: 2 of 8); HF parity holds."""
    d = tiny_moe(tmp_path / "mx", "mixtral")
    used: list[int] = []  # experts that received tokens, per layer pass
    original = SparseMoE.experts

    def spy(self, flat, weights, experts):
        used.append(len(set(experts.reshape(-1).tolist())))
        return original(self, flat, weights, experts)

    monkeypatch.setattr(SparseMoE, "experts", spy)
    assert_hf_parity(d, [[100, 200]], 2, steps=3)
    assert used and max(used) <= 4 and min(used) == 2


def _fused_copy(src: str, dst: Path) -> Path:
    """The same weights saved as transformers 5 holds them in memory: experts fused into 3-D tensors."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    dst.mkdir()
    for f in Path(src).iterdir():
        if f.suffix in (".json", ".jinja") and "index" not in f.name:
            (dst / f.name).write_bytes(f.read_bytes())
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_fused_expert_layout_loads_identically(tmp_path, name):
    d = tiny_moe(tmp_path / name, name)
    fused = _fused_copy(d, tmp_path / "fused")
    ranges = stage_ranges(3, 2)
    for a, b in zip(chain_logits(stage_chain(str(fused), ranges), PROMPTS),
                    chain_logits(stage_chain(d, ranges), PROMPTS), strict=True):
        assert torch.equal(a, b)
    _, store = build_stage(fused, 2, 3, False, False)
    assert sorted(n for n in store.loaded if ".mlp." in n) == [
        "model.layers.2.mlp.experts.down_proj", "model.layers.2.mlp.experts.gate_up_proj",
        "model.layers.2.mlp.gate.weight"] + [f"model.layers.2.mlp.shared_expert{x}" for x in (
            ".down_proj.weight", ".gate_proj.weight", ".up_proj.weight", "_gate.weight")] * (name == "qwen2_moe")


def test_missing_experts_name_both_layouts(tmp_path):
    from safetensors.torch import load_file, save_file

    d = Path(tiny_moe(tmp_path / "mx", "mixtral"))
    state = load_file(d / "model.safetensors")
    del state["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(state, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"experts\.3\.w3\.weight.*/.*mlp\.experts\.gate_up_proj"):
        build_stage(d, 1, 2, False, False)


@pytest.mark.usefixtures("threads")
def test_moe_batch_invariant_and_matches_hf(tmp_path):
    """--batch-invariant: a row's logits are bit-identical whoever shares its micro-batch (and so
    whichever other tokens its experts process), at P = 1 and 2, with 1 and 2 threads."""
    d = tiny_moe(tmp_path / "q2", "qwen2_moe")
    alone = None
    n = len(OTHERS) + 1
    layouts = [([TARGET], [0]), ([TARGET] + OTHERS, list(range(n))), ([TARGET] + OTHERS, list(reversed(range(n))))]
    for stages, th in ((1, 1), (2, 2)):
        torch.set_num_threads(th)
        chain = stage_chain(d, stage_ranges(3, stages), batch_invariant=True)
        for prompts, order in layouts:
            got = _prefill_and_decode(chain, prompts, order)[0]
            if alone is None:
                alone = got
                torch.testing.assert_close(got[0], hf_logits(d, TARGET)[-1], atol=1e-4, rtol=1e-4)
            assert all(torch.equal(a, b) for a, b in zip(got, alone, strict=True)), (stages, th, order)


