"""The embedded default model: a tiny Llama built deterministically, with a local tokenizer.

When the runner is started without ``--model-name`` it uses this model, so a newcomer can run the
examples with no download. Nothing here touches the network:

- the tokenizer is a byte-level BPE (vocab 4096) trained on ``examples/corpus.txt``;
- the model is ``LlamaForCausalLM`` (4 layers, hidden 256, GQA 8 query / 4 KV heads) initialised
  from ``torch.manual_seed(1234)``, saved as float32 safetensors.

Both are byte-identical across builds, so every rank (and every machine) sees the same model.
``default_model_dir()`` builds the folder once into a cache dir and is safe to call from several
processes at once (build into a temporary sibling, then an atomic ``os.rename``).

Build by hand:  python examples/default_model.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay lazy: importing this module must be cheap
    from transformers import PreTrainedTokenizerFast

DEFAULT_MODEL_NAME = "tiny-llama-default-v1"
CORPUS_PATH = Path(__file__).with_name("corpus.txt")
COMPLETE_MARKER = ".complete"
SEED = 1234
VOCAB_SIZE = 4096
BOS, EOS, PAD = "<s>", "</s>", "<pad>"  # ids 0, 1, 2: the trainer puts special tokens first
# Plain-text role markers, so the template needs no extra special tokens:
#   <s>system: ...\nuser: ...\nassistant:
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def cache_root() -> Path:
    """``$DIST_INFER_CACHE`` if set, else ``~/.cache/dist-inference-runner``."""
    env = os.environ.get("DIST_INFER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dist-inference-runner"


def is_complete(path: str | os.PathLike[str]) -> bool:
    """A model folder is complete when its marker (written last, before the rename) exists."""
    return (Path(path) / COMPLETE_MARKER).is_file()


def default_model_dir() -> str:
    """Return the folder of the default model, building it on first use.

    Safe under concurrency: each caller that finds no complete folder builds into its own
    temporary sibling and renames it into place; a caller that loses the race discards its copy
    and uses the winner's. Builds are deterministic, so which copy wins does not matter.
    """
    target = cache_root() / DEFAULT_MODEL_NAME
    if is_complete(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; the final folder follows umask
    try:
        build_default_model(str(tmp))
        try:
            os.rename(tmp, target)
        except OSError:
            # Lost the race (target now exists), or a stale incomplete folder is in the way.
            if not is_complete(target):
                _replace_stale(target, tmp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if not is_complete(target):
        raise RuntimeError(f"failed to build the default model into {target}")
    return str(target)


def _umask() -> int:
    """The process umask (reading it requires setting it, so set it straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _replace_stale(target: Path, fresh: Path) -> None:
    """Move an incomplete ``target`` aside and put ``fresh`` in its place."""
    stale = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.stale-", dir=target.parent))
    try:
        os.rename(target, stale / "old")
    except OSError:
        pass  # another process moved it first
    try:
        os.rename(fresh, target)
    except OSError:
        pass  # another process put its complete copy in place first
    shutil.rmtree(stale, ignore_errors=True)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on the committed corpus; return a ``PreTrainedTokenizerFast``.

    Encoding prepends ``<s>``; decoding with ``skip_special_tokens=True`` returns the text exactly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no <unk> needed
        show_progress=False,
    )
    tok.train([str(CORPUS_PATH)], trainer)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id), (EOS, eos_id)],
    )
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


def build_default_model(out_dir: str) -> None:
    """Write tokenizer, ``config.json``, ``generation_config.json`` and ``model.safetensors``.

    The marker file is written last, so a folder that has it is complete.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out_dir)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,  # GQA: 2 query heads per KV head
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    # Fork the RNG so building does not disturb the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config.do_sample = False
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one bar per rank on stderr is noise
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    for path in Path(out_dir).iterdir():  # safetensors is written 0600; follow the umask
        os.chmod(path, 0o666 & ~_umask())
    Path(out_dir, COMPLETE_MARKER).write_text(f"{DEFAULT_MODEL_NAME}\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    """CLI: build into ``--out`` (or the cache) and print the folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None,
                        help="build into this folder (default: the cache, built once)")
    args = parser.parse_args(argv)
    if args.out is None:
        print(default_model_dir())
    else:
        build_default_model(args.out)
        print(os.path.abspath(args.out))


if __name__ == "__main__":
    main()
