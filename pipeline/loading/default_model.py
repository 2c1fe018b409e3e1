"""The embedded default model: a tiny trained Llama that ships in ``examples/tiny-llama-default/``, used
when the runner is started without ``--model-name`` (what it knows and how it was trained:
docs/usage/default-model.md). Its tokenizer is a byte-level BPE (``<s> </s> <pad>`` = ids 0, 1, 2,
``<s>`` prepended, exact decode round trip) with a plain-text chat template; :func:`build_tokenizer`
loads it for tests and benchmarks. Importing this module is cheap: transformers loads inside functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.paths import cache_root  # noqa: F401 (re-exported: benchmarks build their models under it)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

DEFAULT_MODEL_NAME = "tiny-llama-default-v5"
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"  # the checkout's examples/: weights and corpus
# an installed wheel has no examples/: setup.py copies the model's files beside this module instead
PACKAGED_DIR = Path(__file__).resolve().parent / "tiny-llama-default"
SHIPPED_DIR = PACKAGED_DIR if (PACKAGED_DIR / "model.safetensors").is_file() else EXAMPLES_DIR / "tiny-llama-default"
CORPUS_PATH = EXAMPLES_DIR / "corpus.txt"
BOS, EOS, PAD = "<s>", "</s>", "<pad>"  # ids 0, 1, 2: the trainer puts special tokens first
# Plain-text role markers, so the template needs no extra special tokens:
#   <s>system: ...\nuser: ...\nassistant:
# With ``chat_template_kwargs: {"enable_thinking": true}`` the answer starts inside ``<think>\n`` (as
# DeepSeek-R1's template starts it): the model (v5 on) writes a short trace, ``\n</think>\n\n``, then
# the answer (docs/usage/reasoning.md). The markers are plain text (several BPE tokens each).
THINK_START, THINK_END = "<think>", "</think>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and enable_thinking %}<think>\n"
    "{% endif %}{% endif %}"
)


def default_model_dir() -> str:
    """The folder of the shipped default model (config, safetensors, tokenizer files)."""
    if not (SHIPPED_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the default model is missing from {SHIPPED_DIR}; restore it from git, or retrain it "
            "with: python examples/train_default_model.py")
    return str(SHIPPED_DIR)


def make_tokenizer(tok: Any) -> PreTrainedTokenizerFast:
    """Wrap a trained ``tokenizers.Tokenizer``: BOS prepended, left padding, exact round trip."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id), (EOS, eos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",  # decoder-only batch generation pads on the left
        clean_up_tokenization_spaces=False,  # keep decode(encode(s)) == s
        model_max_length=2048,
        chat_template=CHAT_TEMPLATE,
    )


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The default model's tokenizer as a ``PreTrainedTokenizerFast`` (loaded, never downloaded)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir(), local_files_only=True)


if __name__ == "__main__":
    print(default_model_dir())
