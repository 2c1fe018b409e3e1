"""OPT, BLOOM and GPT-2 parity with HuggingFace: logits close, greedy tokens equal, for P = 1, 2, 3.

Every parameter (biases and LayerNorm affines included, which HF initializes to 0/1) is randomized
before saving, so a wrong bias, norm or fused-qkv slice cannot hide behind an identity value.
"""

import pytest
import torch

from pipeline.models.families import family_for, supported_model_types
from tests.utils import assert_hf_parity, local_tokenizer, save_hf_model, stage_chain

PROMPTS = [[5, 17, 300, 42, 9, 11, 1000, 7, 13], [100, 200], [31, 1020, 8, 99, 900]]  # ids < 1024 (the local vocab)

VARIANTS = {
    "opt": ("opt", dict(hidden_size=64, ffn_dim=96, num_hidden_layers=3, num_attention_heads=4,
                        max_position_embeddings=128)),
    # OPT-350m layout: post-norm blocks, no final norm, 32-wide embeddings projected in and out
    "opt-350m-style": ("opt", dict(hidden_size=64, ffn_dim=96, num_hidden_layers=3, num_attention_heads=4,
                                   max_position_embeddings=128, do_layer_norm_before=False, word_embed_proj_dim=32)),
    # 6 heads: ALiBi slopes for a head count that is not a power of two
    "bloom": ("bloom", dict(hidden_size=48, n_layer=3, n_head=6)),
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=3, n_head=4, n_positions=128)),
}


def build(tmp_path, family: str, seed: int = 0, **kw) -> str:
    """A random tiny HF model of `family` with every parameter randomized, saved with the local tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = local_tokenizer()
    cfg = AutoConfig.for_model(family, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn_like(p) * 0.1
            p.copy_(1 + noise if p.dim() == 1 and name.endswith("weight") else noise)  # norm weights near 1
    return save_hf_model(model, tmp_path)


def check_parity(model_dir: str, stages: int, num_layers: int = 3, model_type: str | None = None) -> None:
    assert_hf_parity(model_dir, PROMPTS, stages, num_layers, model_type)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model_dir(request, tmp_path_factory):
    family, kw = VARIANTS[request.param]
    return build(tmp_path_factory.mktemp(request.param), family, **kw)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_logits_and_greedy_match_hf(model_dir, stages):
    check_parity(model_dir, stages)


def test_opt_350m_style_has_projection_and_no_final_norm():
    _, kw = VARIANTS["opt-350m-style"]
    spec = family_for({"model_type": "opt"}).to_spec({"model_type": "opt", "vocab_size": 10, "num_hidden_layers": 2, **kw})
    assert (spec.embed_dim, spec.pre_norm, spec.final_norm) == (32, False, False)
    assert spec.learned_pos_offset == 2 and spec.tie_embeddings


@pytest.mark.parametrize("family,kw", [
    # OPT without LayerNorm affines (no norm tensors in the checkpoint) and without linear biases
    ("opt", dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                 layer_norm_elementwise_affine=False, enable_bias=False)),
    # GPT-2 attention-scale knobs, folded into the query rows; untied head
    ("gpt2", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, scale_attn_weights=False,
                  scale_attn_by_inverse_layer_idx=True, tie_word_embeddings=False)),
    ("bloom", dict(hidden_size=32, n_layer=2, n_head=4, tie_word_embeddings=False)),
])
def test_config_variants(tmp_path, family, kw):
    check_parity(build(tmp_path, family, seed=1, **kw), stages=2, num_layers=2)


def test_model_type_spellings_resolve():
    for name in ("opt", "bloom", "gpt2"):
        mod = family_for({"model_type": name}, name)
        assert mod.__name__ == f"pipeline.models.families.{name}"
        assert family_for({"model_type": name}) is mod  # read from config.json
        assert family_for({"model_type": "llama"}, name) is mod  # --model-type wins over config
        assert name in supported_model_types()


def test_explicit_model_type_loads(tmp_path):
    d = build(tmp_path, "gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64)
    (stage,) = stage_chain(d, [(0, 2)], model_type="gpt2")
    assert stage.spec.family == "gpt2" and stage.pos_embed is not None


def test_unsupported_model_type_lists_supported():
    with pytest.raises(ValueError, match="supported:") as e:
        family_for({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]})
    for name in ("opt", "bloom", "gpt2", "llama"):
        assert name in str(e.value)


def test_bloom_post_layernorm_residual_rejected():
    cfg = {"model_type": "bloom", "vocab_size": 10, "hidden_size": 32, "n_layer": 2, "n_head": 4,
           "apply_residual_connection_post_layernorm": True}
    with pytest.raises(ValueError, match="apply_residual_connection_post_layernorm"):
        family_for(cfg).to_spec(cfg)
