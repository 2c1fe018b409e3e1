"""Structured outputs on the device side: grammars compiled with llguidance, one matcher per row,
the next token's mask for a micro-batch.

A request's constraint travels as a small JSON spec (``Params.structured``: ``{"kind", "value"}``,
see tasks.requests) in the message that admits it, so any rank can compile it. :class:`Grammars`
compiles each distinct spec once per process (cached by its canonical text) and hands each row a
copy of the compiled matcher. Rank 0 compiles at intake with a time limit (pipeline.scheduling.grammars);
the last rank then finds the spec in its own cache (the same object at P = 1) or compiles it once.

Why llguidance (measured on this CPU, docs/usage/structured-outputs.md): it compiles a JSON schema in
~2 ms (xgrammar ~10-25 ms here) because it builds the lexer lazily, takes Lark (and GBNF through its
converter), regexes and JSON schemas as one grammar format, and bounds its own work per token.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import orjson
import torch

import llguidance
import llguidance.gbnf_to_lark
import llguidance.hf
import llguidance.torch

# compact JSON: a model (above all a random one) would otherwise fill the output with whitespace
JSON_DEFAULTS = {"whitespace_flexible": False}
MAX_CACHED = 2048  # distinct compiled grammars a process keeps


class GrammarError(ValueError):
    """A constraint that cannot be compiled (its reason in the message)."""


def spec_key(spec: dict) -> str:
    """The canonical text of a spec: equal constraints share one compiled grammar."""
    return orjson.dumps(spec, option=orjson.OPT_SORT_KEYS).decode()


def grammar_text(spec: dict) -> str:
    """The llguidance grammar of a spec ({"kind": json|json_object|regex|choice|grammar, "value"})."""
    kind, value = spec["kind"], spec.get("value")
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_DEFAULTS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in value))
    if kind == "grammar":
        lark = value
        if "::=" in value:  # GBNF (llama.cpp): converted to Lark by llguidance
            try:
                lark = llguidance.gbnf_to_lark.gbnf_to_lark(value)
            except Exception as e:
                raise GrammarError(f"the GBNF grammar cannot be read: {str(e)[:300]}") from e
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise GrammarError(f"unknown constraint kind {kind!r}")


class Grammars:
    """Compiled matchers of one tokenizer, by spec; thread-safe (rank 0 compiles on a worker thread)."""

    def __init__(self, tokenizer, vocab_size: int):
        self._hf_tok, self.tok = tokenizer, None  # llguidance's view, built on first use: a slow tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self._ready: dict[str, llguidance.LLMatcher | GrammarError] = {}
        self._lock = threading.Lock()
        self.compile_seconds = 0.0
        self.compiled = 0  # distinct grammars compiled

    def compile(self, spec: dict) -> llguidance.LLMatcher:
        """The pristine matcher of ``spec`` (compiled on first use); raises :class:`GrammarError`."""
        key = spec_key(spec)
        with self._lock:
            got = self._ready.get(key)
        if got is None:
            t0 = time.perf_counter()
            try:
                if self.tok is None:  # (sentencepiece only) fails only the constrained requests, not the run
                    self.tok = llguidance.hf.from_tokenizer(self._hf_tok)
                m = llguidance.LLMatcher(self.tok, grammar_text(spec), log_level=0)
                # the first mask builds the lexer's start states: part of compiling, bounded with it
                bm = torch.zeros(1, (self.tok.vocab_size + 31) // 32, dtype=torch.int32)
                llguidance.torch.fill_next_token_bitmask(m, bm, 0)
                got = GrammarError(m.get_error()[:500]) if m.is_error() else m
            except GrammarError as e:
                got = e
            except Exception as e:  # the library refusing a schema/regex/grammar
                got = GrammarError(str(e)[:500] or type(e).__name__)
            with self._lock:
                self.compile_seconds += time.perf_counter() - t0
                self.compiled += 1
                self._ready[key] = got
                if len(self._ready) > MAX_CACHED:  # a long-lived server: the oldest grammar goes (rows keep copies)
                    del self._ready[next(iter(self._ready))]
        if isinstance(got, GrammarError):
            raise got
        return got

    def matcher(self, spec: dict) -> llguidance.LLMatcher:
        """A fresh matcher for one row (a copy of the compiled one)."""
        return self.compile(spec).deep_copy()

    def known(self, spec: dict) -> bool:
        with self._lock:
            return spec_key(spec) in self._ready


def allowed_mask(matchers: list, eos_ids: set[int], tok_vocab: int, vocab: int,
                 device: torch.device) -> torch.Tensor:
    """(R, vocab) bool: the tokens each row's matcher allows next (a row whose matcher is None: every
    token). Ids the tokenizer does not know (``tok_vocab`` and beyond) are never allowed in a
    constrained row; the end of the output (any of ``eos_ids``) is allowed exactly where the grammar
    may end. On the host in numpy (a handful of small torch ops cost more than the masks themselves),
    one copy to the device."""
    words = (tok_vocab + 31) // 32
    bm = np.zeros((len(matchers), words), dtype=np.int32)  # bit j of word w: token 32w + j
    for i, m in enumerate(matchers):
        if m is not None:
            m.unsafe_compute_mask_ptr(bm[i].ctypes.data, words * 4)
    bits = np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little")  # (R, words * 32), little-endian words
    allowed = np.zeros((len(matchers), vocab), dtype=bool)
    n = min(vocab, words * 32)
    allowed[:, :n] = bits[:, :n]
    eos = [t for t in sorted(eos_ids) if t < vocab]
    for i, m in enumerate(matchers):
        if m is None:
            allowed[i] = True
        elif eos:
            allowed[i, eos] = m.is_accepting()
    return torch.from_numpy(allowed).to(device)
