"""Llama-family parity with HuggingFace: logits close, greedy tokens equal, for P = 1, 2, 3."""

import pytest
import torch

from tests.utils import assert_hf_parity, chain_logits, hf_logits, stage_chain, tiny_llama
from pipeline.config.partition import stage_ranges

PROMPTS = [[5, 17, 300, 42, 9, 11, 1000, 7, 13], [100, 200], [31, 1020, 8, 99, 900]]  # ids < 1024 (the local vocab)

VARIANTS = {
    "llama": {},
    "llama-gqa": {"num_key_value_heads": 2},
    "llama3-rope": {"num_key_value_heads": 1, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    "llama-linear-rope": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    "llama-attn-bias": {"attention_bias": True},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model_dir(request, tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_logits_and_greedy_match_hf(model_dir, stages):
    assert_hf_parity(model_dir, PROMPTS, stages)


def _save(model, tmp_path):
    from tests.utils import save_hf_model

    return save_hf_model(model.eval(), tmp_path)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_mistral_and_qwen2(family, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.utils import local_tokenizer

    torch.manual_seed(1)
    cfg = AutoConfig.for_model(family, vocab_size=len(local_tokenizer()), hidden_size=64, intermediate_size=96,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256, tie_word_embeddings=family == "qwen2")
    d = _save(AutoModelForCausalLM.from_config(cfg), tmp_path)
    chain = stage_chain(d, stage_ranges(2, 2))
    for prompt, ours in zip(PROMPTS, chain_logits(chain, PROMPTS), strict=True):
        torch.testing.assert_close(ours, hf_logits(d, prompt), atol=1e-4, rtol=1e-4)
