"""Tokenizers from a local model folder: whatever ``AutoTokenizer`` loads, and folders that hold only a
sentencepiece ``tokenizer.model`` (read with sentencepiece directly when transformers cannot convert it).
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import json
import logging
import os
from pathlib import Path

from pipeline.loading.stage_weights import CheckpointError

log = logging.getLogger(__name__)


def load_tokenizer(model_dir: str | os.PathLike, trust_remote_code: bool = False):
    """AutoTokenizer from a local folder, or the sentencepiece fallback for ``tokenizer.model``-only folders.

    transformers 5 always builds a fast tokenizer; from a bare ``tokenizer.model`` that conversion
    needs ``protobuf`` (and otherwise falls back to tiktoken and fails). Without protobuf, or if
    the conversion fails, such folders get :class:`SentencePieceTokenizer`, which runs the
    sentencepiece model directly and honours ``add_bos_token``/``add_eos_token`` of tokenizer_config.json.
    """
    d = Path(model_dir)
    sp_only = (d / "tokenizer.model").is_file() and not (d / "tokenizer.json").is_file()
    if sp_only and not _has_protobuf():
        log.info("%s: tokenizer.model only and no protobuf: using the sentencepiece tokenizer directly", d)
        return sentencepiece_tokenizer(d)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(d), trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:
        if not sp_only:
            raise CheckpointError(f"{d}: cannot load the tokenizer: {e}") from e
        log.warning("%s: AutoTokenizer failed (%s); using the sentencepiece tokenizer directly", d, e)
        return sentencepiece_tokenizer(d)


def own_copy(tok):
    """A copy of ``tok`` for one thread: a fast tokenizer must not be used by two threads at once."""
    try:
        return copy.deepcopy(tok)
    except Exception:  # noqa: BLE001 - not copyable: share it (encoding only reads it)
        return tok


def _has_protobuf() -> bool:
    try:
        return importlib.util.find_spec("google.protobuf") is not None
    except ImportError:  # no "google" package at all
        return False


def sentencepiece_tokenizer(model_dir: str | os.PathLike):
    """A slow tokenizer over ``tokenizer.model`` configured by ``tokenizer_config.json`` (Llama conventions)."""
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    class SentencePieceTokenizer(SentencePieceBackend):
        """sentencepiece encode/decode; BOS/EOS added per add_bos_token (default true) / add_eos_token."""

        model_input_names = ["input_ids", "attention_mask"]

        def __init__(self, vocab_file, add_bos_token=True, add_eos_token=False, **kwargs):
            self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
            kwargs["legacy"] = True  # legacy=False needs protobuf; same ids for text without special tokens
            super().__init__(vocab_file=vocab_file, **kwargs)

        def build_inputs_with_special_tokens(self, ids0, ids1=None):
            bos = [self.bos_token_id] if self.add_bos_token and self.bos_token_id is not None else []
            eos = [self.eos_token_id] if self.add_eos_token and self.eos_token_id is not None else []
            return bos + ids0 + eos + ([] if ids1 is None else bos + ids1 + eos)

        def _decode(self, token_ids, skip_special_tokens=False, **kwargs) -> str:
            ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
            specials, out = set(self.all_special_ids), []
            for special, run in itertools.groupby(ids, specials.__contains__):  # text between special tokens
                if not special:
                    out.append(self.sp_model.decode(list(run)))
                elif not skip_special_tokens:
                    out += [self.convert_ids_to_tokens(i) for i in run]
            return "".join(out)

    d = Path(model_dir)
    defaults = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    wanted = ("add_bos_token", "add_eos_token", "pad_token", "model_max_length", "chat_template", *defaults)
    try:
        kwargs = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
            if (d / name).is_file():
                kwargs.update({k: v for k, v in json.loads((d / name).read_text()).items() if k in wanted})
        template = d / "chat_template.jinja"
        if "chat_template" not in kwargs and template.is_file():
            kwargs["chat_template"] = template.read_text()
        return SentencePieceTokenizer(vocab_file=str(d / "tokenizer.model"), **{**defaults, **kwargs})
    except Exception as e:
        raise CheckpointError(f"{d}: cannot load the sentencepiece tokenizer from tokenizer.model: {e}") from e
