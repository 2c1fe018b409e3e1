"""GPT-NeoX, GPT-J and Falcon parity with HuggingFace (logits close, greedy equal) for P = 1, 2, 3,
plus --model-type spellings and config edge cases."""

import pytest

from pipeline.models.families import family_for, spec_from_config, supported_model_types
from tests.utils import assert_hf_parity, random_hf_model

PROMPTS = [[5, 17, 300, 42, 9, 11, 1000, 7, 13], [100, 200], [31, 1020, 8, 99, 900]]  # ids < 1024 (the local vocab)

# model_type -> config overrides; all 3 layers, head_dim >= 8
VARIANTS = {
    "neox-parallel": ("gpt_neox", dict(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                       rotary_pct=0.5, use_parallel_residual=True)),
    "neox-sequential": ("gpt_neox", dict(hidden_size=64, num_attention_heads=4, intermediate_size=96,
                                         rotary_pct=0.25, use_parallel_residual=False, attention_bias=False)),
    "gptj": ("gptj", dict(n_embd=64, n_head=4, n_inner=128, rotary_dim=8)),
    "falcon-new-gqa": ("falcon", dict(hidden_size=64, num_attention_heads=8, num_kv_heads=2, ffn_hidden_size=96,
                                      new_decoder_architecture=True, bias=True, tie_word_embeddings=False)),
    "falcon-7b-mq": ("falcon", dict(hidden_size=64, num_attention_heads=4, new_decoder_architecture=False,
                                    multi_query=True, parallel_attn=True, bias=False)),
    "falcon-mha-sequential": ("falcon", dict(hidden_size=48, num_attention_heads=4, new_decoder_architecture=False,
                                             multi_query=False, parallel_attn=False, bias=True)),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model_dir(request, tmp_path_factory):
    model_type, overrides = VARIANTS[request.param]
    return random_hf_model(tmp_path_factory.mktemp(request.param), model_type, **overrides)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_logits_and_greedy_match_hf(model_dir, stages):
    assert_hf_parity(model_dir, PROMPTS, stages)


def test_variant_specs():
    """The fixtures really exercise what they are named after."""
    specs = {}
    for name in ("falcon-new-gqa", "falcon-7b-mq", "falcon-mha-sequential"):
        model_type, overrides = VARIANTS[name]
        cfg = dict(vocab_size=64, num_hidden_layers=1, model_type=model_type, **overrides)
        specs[name] = spec_from_config(cfg)
    gqa, mq, seq = specs["falcon-new-gqa"], specs["falcon-7b-mq"], specs["falcon-mha-sequential"]
    assert (gqa.num_kv_heads, gqa.parallel_residual, gqa.shared_norm) == (2, True, False)
    assert (mq.num_kv_heads, mq.parallel_residual, mq.shared_norm, mq.tie_embeddings) == (1, True, True, True)
    assert (seq.num_kv_heads, seq.parallel_residual) == (4, False)


@pytest.mark.parametrize("spelling,module", [("gptneox", "gpt_neox"), ("gpt_neox", "gpt_neox"), ("gptj", "gptj"),
                                             ("falcon", "falcon")])
def test_model_type_spellings(spelling, module):
    assert family_for({"model_type": "llama"}, spelling).__name__ == f"pipeline.models.families.{module}"
    assert spelling in supported_model_types()


def test_neox_legacy_config_keys():
    """Original Pythia configs: rotary_pct / rotary_emb_base instead of rope_parameters (default pct 0.25)."""
    base = dict(model_type="gpt_neox", vocab_size=64, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                intermediate_size=256)
    legacy = spec_from_config({**base, "rotary_pct": 0.5, "rotary_emb_base": 500.0})
    new = spec_from_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                        "partial_rotary_factor": 0.5}})
    assert legacy.rope == new.rope and legacy.rope.rotary_dim == 8 and legacy.rope.theta == 500.0
    assert spec_from_config(base).rope.rotary_dim == 4  # HF's default rotary_pct is 0.25


def test_falcon_alibi_rejected():
    cfg = dict(model_type="falcon", vocab_size=64, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
               alibi=True)
    with pytest.raises(ValueError, match="alibi"):
        spec_from_config(cfg)
