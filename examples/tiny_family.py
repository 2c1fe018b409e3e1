"""Build a tiny random model of any supported family, with the project's local tokenizer.

    python examples/tiny_family.py opt /tmp/tiny-opt
    python dist_inference_runner.py --model-name /tmp/tiny-opt --infer-data examples/requests.jsonl

Useful to try a family's code path (or a launch recipe) without downloading a checkpoint; the
weights are random, so the text is meaningless. Families: llama, mistral, qwen2, qwen3, gemma,
gemma2, gemma3, phi3, olmo2, mixtral, qwen2_moe, qwen3_moe, opt, opt-350m, bloom, gpt2, gpt_neox,
gptj, falcon; and, run by the generic transformers stage (no native code), starcoder2 (sliding
window) and granite (embedding/residual/attention multipliers, logits scaling).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COMMON = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=2048)
CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(COMMON, intermediate_size=128, num_key_value_heads=2)),
    "mistral": ("mistral", dict(COMMON, intermediate_size=128, num_key_value_heads=2)),
    "qwen2": ("qwen2", dict(COMMON, intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(COMMON, intermediate_size=128, num_key_value_heads=2, head_dim=32)),
    "gemma": ("gemma", dict(COMMON, intermediate_size=128, num_key_value_heads=2, head_dim=16)),
    "gemma2": ("gemma2", dict(COMMON, intermediate_size=128, num_key_value_heads=2, head_dim=16, sliding_window=16)),
    "gemma3": ("gemma3_text", dict(COMMON, intermediate_size=128, num_key_value_heads=2, head_dim=16,
                                   sliding_window=16, sliding_window_pattern=2)),
    "phi3": ("phi3", dict(COMMON, intermediate_size=128, num_key_value_heads=2)),
    "olmo2": ("olmo2", dict(COMMON, intermediate_size=128, num_key_value_heads=2)),
    "opt": ("opt", dict(COMMON, ffn_dim=128, word_embed_proj_dim=64)),
    "opt-350m": ("opt", dict(COMMON, ffn_dim=128, word_embed_proj_dim=32, do_layer_norm_before=False)),
    "bloom": ("bloom", dict(hidden_size=64, n_layer=4, n_head=4)),
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=4, n_head=4, n_positions=1024)),
    "gpt_neox": ("gpt_neox", dict(COMMON, intermediate_size=128, rotary_pct=0.5)),
    "gptj": ("gptj", dict(n_embd=64, n_layer=4, n_head=4, rotary_dim=8, n_positions=2048)),
    "falcon": ("falcon", dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_kv_heads=2,
                              new_decoder_architecture=True, max_position_embeddings=2048)),
    "mixtral": ("mixtral", dict(COMMON, intermediate_size=96, num_key_value_heads=2, num_local_experts=8)),
    "qwen2_moe": ("qwen2_moe", dict(COMMON, intermediate_size=128, num_key_value_heads=2, num_experts=8,
                                    num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96)),
    "qwen3_moe": ("qwen3_moe", dict(COMMON, intermediate_size=128, num_key_value_heads=2, head_dim=16, num_experts=8,
                                    num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)),
    "starcoder2": ("starcoder2", dict(COMMON, intermediate_size=128, num_key_value_heads=2, sliding_window=16)),
    "granite": ("granite", dict(COMMON, intermediate_size=128, num_key_value_heads=2, embedding_multiplier=12.0,
                                residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0)),
}


def build(family: str, out_dir: str, seed: int = 0) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.loading.default_model import build_tokenizer

    model_type, kwargs = CONFIGS[family]
    tok = build_tokenizer()
    cfg = AutoConfig.for_model(model_type, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family", choices=sorted(CONFIGS))
    ap.add_argument("out_dir")
    args = ap.parse_args(argv)
    print(build(args.family, args.out_dir))


if __name__ == "__main__":
    main()
