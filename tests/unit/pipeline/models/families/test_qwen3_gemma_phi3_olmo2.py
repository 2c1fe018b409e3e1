"""Qwen3, Gemma 1/2/3, Phi-3/4, OLMo 2 and sliding-window Mistral/Qwen parity with HuggingFace
(logits of a mixed-length micro-batch close, greedy tokens equal) for P = 1, 2, 3, also in
batch-invariant mode; prompts are several sliding windows long."""

import pytest
import torch

from pipeline.models.families import spec_from_config
from pipeline.config.partition import stage_ranges
from tests.utils import assert_hf_parity, chain_greedy, chain_logits, hf_greedy, hf_logits, local_tokenizer, random_hf_model, stage_chain

SHORT = [[5, 17, 300, 42, 9, 11, 1000, 7, 13], [100, 200], [31, 1020, 8, 99, 900]]
LONG = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 383, 279, 502, 88, 41, 97, 169, 399, 37, 510, 58, 20]
PROMPTS = SHORT + [LONG]  # 9, 2, 5 and 25 tokens: windows below are 4-6 tokens

GQA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.3, 1.7, 2.0, 2.5, 3.0],
                long_factor=[1.5, 2.0, 3.0, 4.0, 6.0, 8.0], original_max_position_embeddings=16)

# name -> (model_type, config overrides); every model has 3 layers
VARIANTS = {
    "qwen3": ("qwen3", dict(GQA, head_dim=24)),  # head_dim independent of hidden / heads
    "qwen3-sliding": ("qwen3", dict(GQA, head_dim=16, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "mistral-sliding": ("mistral", dict(GQA, sliding_window=5)),
    "gemma": ("gemma", dict(GQA, head_dim=16)),
    "gemma2": ("gemma2", dict(GQA, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                              attn_logit_softcapping=0.05, final_logit_softcapping=0.5)),
    "gemma3": ("gemma3_text", dict(GQA, head_dim=16, sliding_window=4, query_pre_attn_scalar=20,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 20000.0}})),
    "phi3-longrope": ("phi3", dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                   max_position_embeddings=64, original_max_position_embeddings=16,
                                   rope_parameters=dict(LONGROPE, rope_theta=10000.0, partial_rotary_factor=0.5),
                                   sliding_window=6)),
    "phi4": ("phi3", dict(GQA)),
    "olmo2": ("olmo2", dict(GQA)),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model_dir(request, tmp_path_factory):
    model_type, overrides = VARIANTS[request.param]
    return random_hf_model(tmp_path_factory.mktemp(request.param), model_type, **overrides)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_logits_and_greedy_match_hf(model_dir, stages):
    assert_hf_parity(model_dir, PROMPTS, stages)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3-longrope", "qwen3-sliding", "olmo2"])
def test_batch_invariant_mode_matches_hf(name, tmp_path):
    """Per-row attention with windows, soft-capping, longrope rows and q/k norms in fixed tiles."""
    model_type, overrides = VARIANTS[name]
    path = random_hf_model(tmp_path, model_type, **overrides)
    chain = stage_chain(path, stage_ranges(3, 2), batch_invariant=True)
    for prompt, ours in zip(PROMPTS, chain_logits(chain, PROMPTS), strict=True):
        torch.testing.assert_close(ours, hf_logits(path, prompt), atol=1e-4, rtol=1e-4)
    toks, _ = chain_greedy(chain, PROMPTS, 4)
    assert toks == [hf_greedy(path, p, 4)[0] for p in PROMPTS]


def test_variant_specs():
    """The fixtures exercise what they are named after."""
    specs = {name: spec_from_config(dict(vocab_size=64, num_hidden_layers=3, model_type=mt, **kw))
             for name, (mt, kw) in VARIANTS.items()}
    assert specs["qwen3"].qk_norm == "head" and specs["qwen3"].head_dim == 24
    assert specs["qwen3-sliding"].layer_kinds == ("full", "sliding", "sliding")
    assert specs["mistral-sliding"].layer_kinds == ("sliding",) * 3 and specs["mistral-sliding"].sliding_window == 5
    g2, g3 = specs["gemma2"], specs["gemma3"]
    assert g2.layer_kinds == ("sliding", "full", "sliding") and (g2.attn_softcap, g2.final_softcap) == (0.05, 0.5)
    assert g2.post_branch_norm and g2.norm_offset == 1.0 and g2.attn_scale == 24**-0.5
    assert g3.qk_norm == "head" and g3.local_rope.theta == 500.0 and g3.rope.scaling_type == "linear"
    phi = specs["phi3-longrope"]
    assert phi.rope.scaling_type == "longrope" and phi.rope.rotary_dim == 12 and phi.is_sliding(0)
    assert phi.rope.attention_factor == pytest.approx((1 + torch.log(torch.tensor(4.0)).item()
                                                       / torch.log(torch.tensor(16.0)).item()) ** 0.5)
    assert specs["olmo2"].qk_norm == "full" and not specs["olmo2"].pre_norm
    assert spec_from_config(dict(vocab_size=64, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                 intermediate_size=96, model_type="qwen2", sliding_window=4096)).layer_kinds == ()


def test_hub_style_configs():
    """Configs written by transformers 4.x (what most checkpoints on disk carry)."""
    base = dict(vocab_size=64, hidden_size=64, num_attention_heads=4, num_hidden_layers=6, intermediate_size=96)
    g3 = spec_from_config(dict(base, model_type="gemma3_text", head_dim=16, sliding_window=512, rope_theta=1e6,
                               rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                               sliding_window_pattern=6))
    assert g3.layer_kinds == ("sliding",) * 5 + ("full",)
    assert (g3.rope.theta, g3.rope.factor, g3.local_rope.theta) == (1e6, 8.0, 1e4)
    phi = spec_from_config(dict(base, model_type="phi3", max_position_embeddings=131072,
                                original_max_position_embeddings=4096,
                                rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}))
    assert phi.rope.scaling_type == "longrope" and phi.rope.original_max_position == 4096
    g1 = spec_from_config(dict(base, model_type="gemma", hidden_act="gelu", head_dim=16))
    assert g1.activation == "gelu_tanh" and g1.tie_embeddings
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        spec_from_config(dict(base, model_type="qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_gemma3_image_text_checkpoint_runs_its_text_decoder(tmp_path):
    """Gemma 3 4B+ ship as Gemma3ForConditionalGeneration: the text decoder's logits equal HF's
    (text-only input), and no vision tensor is read."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from pipeline.loading.stage_weights import build_stage

    tok = local_tokenizer()
    text = dict(GQA, vocab_size=len(tok), num_hidden_layers=3, head_dim=16, sliding_window=4,
                sliding_window_pattern=2, rope_scaling={"rope_type": "linear", "factor": 2.0})
    cfg = Gemma3Config(text_config=text, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                            num_attention_heads=2, image_size=28, patch_size=14),
                       mm_tokens_per_image=4, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = str(tmp_path / "g3")
    model.save_pretrained(path)
    chain = stage_chain(path, [(0, 2), (2, 3)])
    with torch.inference_mode():
        for prompt, ours in zip(PROMPTS, chain_logits(chain, PROMPTS), strict=True):
            ref = model(input_ids=torch.tensor([prompt])).logits[0].float()
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    _, store = build_stage(path, 0, 3, True, True)
    assert store.loaded and not any("vision" in n or "multi_modal" in n for n in store.loaded)
