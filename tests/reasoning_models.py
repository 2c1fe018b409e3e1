"""Tiny random thinking models for the reasoning tests: the local BPE plus the markers and role tokens of
a family, its chat template's way of opening an answer, and random weights (no download).

- ``qwen3``: a Qwen3ForCausalLM; ``<|im_start|>``/``<|im_end|>`` (special, the latter its EOS),
  ``<think>``/``</think>`` single tokens that decode into the text; a ChatML template written after
  Qwen3's (its generation prompt: ``<|im_start|>assistant\\n``, and ``<think>\\n\\n</think>\\n\\n`` after it
  when ``enable_thinking`` is false; tools and multi-turn thinking left out). The answer MAY open a
  thinking (the model writes ``<think>``).
- ``deepseek``: a LlamaForCausalLM (as DeepSeek-R1's Llama distills); ``<｜User｜>``/``<｜Assistant｜>``
  role tokens and a template after DeepSeek-R1's (0528) whose generation prompt ends inside the
  thinking: ``<｜Assistant｜><think>\\n``.
- ``harmony``: a template that writes gpt-oss's channels (``<|channel|>``), which the runner refuses to parse.

A random model never closes its thinking, so the budget's forced end is what these show; the default
model (which learned a thinking format) shows a thinking that ends on its own.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken

from pipeline.loading.default_model import build_tokenizer

QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{{ message.content }}"
    "{%- elif message.role == 'user' %}{{ '<｜User｜>' + message.content }}"
    "{%- else %}{{ '<｜Assistant｜>' + message.content + '<｜end▁of▁sentence｜>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{%- endif %}"
)
HARMONY_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
    "{#- the answer opens with <|channel|>analysis<|message|> -#}"
)
FAMILIES = {
    "qwen3": (["<|im_start|>", "<|im_end|>"], QWEN3_TEMPLATE),
    "deepseek": (["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"], DEEPSEEK_TEMPLATE),
    "harmony": (["<|start|>", "<|message|>", "<|end|>", "<|channel|>"], HARMONY_TEMPLATE),
}


def thinking_tokenizer(family: str):
    """The local BPE with ``family``'s role tokens (special) and ``<think>``/``</think>`` (one token each,
    not special), and its chat template."""
    special, template = FAMILIES[family]
    tok = build_tokenizer()  # a fresh one (tests.utils.local_tokenizer's is shared)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in special], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.chat_template = template
    if family == "qwen3":
        tok.eos_token = "<|im_end|>"
    return tok


def tiny_thinking_model(out_dir, family: str, seed: int = 0, layers: int = 2) -> str:
    """A random tiny model of ``family`` saved with its tokenizer into ``out_dir``; returns the folder."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tok = thinking_tokenizer(family)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    out = Path(out_dir)
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)
