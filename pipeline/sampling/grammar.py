"""Structured outputs on the device side: grammars compiled with llguidance, one matcher per row,
the next token's mask for a micro-batch.

A request's constraint travels as a small JSON spec (``Params.structured``: ``{"kind", "value"}``) in
the message that admits it, so any rank can compile it; :class:`Grammars` compiles each distinct spec
once per process. Why llguidance, and how masks are computed ahead: docs/usage/structured-outputs.md.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import orjson
import torch

import llguidance
import llguidance.gbnf_to_lark

# compact JSON: a model (above all a random one) would otherwise fill the output with whitespace
JSON_DEFAULTS = {"whitespace_flexible": False}
MAX_CACHED = 2048  # distinct compiled grammars a process keeps


class GrammarError(ValueError):
    """A constraint that cannot be compiled (its reason in the message)."""


def spec_key(spec: dict) -> str:
    """The canonical text of a spec: equal constraints share one compiled grammar."""
    return orjson.dumps(spec, option=orjson.OPT_SORT_KEYS).decode()


def grammar_text(spec: dict, max_string: int = 0) -> str:
    """The llguidance grammar of a spec ({"kind": json|json_object|regex|choice|grammar, "value"});
    ``max_string``: the length of a JSON schema's strings that set none (0: unbounded; see bound_strings)."""
    kind, value = spec["kind"], spec.get("value")
    if kind == "json":
        schema = bound_strings(value, max_string) if max_string else value
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
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


# the keywords whose value is a schema, a list of schemas, or a map of names to schemas (JSON Schema 2020-12)
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_OWN_BOUND = ("maxLength", "pattern", "format", "enum", "const")  # a string schema that bounds itself
INT_BOUND = 10**18 - 1  # an unbounded integer's range: 18 digits (llguidance compiles ranges up to about here)


def bound_strings(schema, max_length: int):
    """A copy of ``schema`` where every string that sets no length of its own (no maxLength, pattern, format,
    enum or const) gets ``maxLength: max_length`` (its minLength permitting), and every integer without a
    bound on a side gets ``±INT_BOUND`` there, so that a model that would never close a string or stop
    writing digits (a small model asked for a plain ``str`` or ``int`` field) still ends with valid JSON:
    the grammar closes the value. --json-string-max-length sets the length (0: neither bound)."""
    if isinstance(schema, list):
        return [bound_strings(s, max_length) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _ONE or key in _LIST:
            out[key] = bound_strings(value, max_length)
        elif key in _MAP and isinstance(value, dict):
            out[key] = {name: bound_strings(s, max_length) for name, s in value.items()}
        else:
            out[key] = value
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds and not any(k in schema for k in _OWN_BOUND):
        least = schema.get("minLength")
        out["maxLength"] = max(max_length, least) if isinstance(least, int) and not isinstance(least, bool) \
            else max_length
    if "integer" in kinds and "enum" not in schema and "const" not in schema:
        if "minimum" not in schema and "exclusiveMinimum" not in schema and _below(-INT_BOUND, schema.get("maximum")):
            out["minimum"] = -INT_BOUND
        if "maximum" not in schema and "exclusiveMaximum" not in schema and _below(schema.get("minimum"), INT_BOUND):
            out["maximum"] = INT_BOUND
    return out


def _below(a, b) -> bool:
    """a <= b where both are numbers (a missing one: no constraint, True)."""
    ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    return not ok or a <= b


class Grammars:
    """Compiled matchers of one tokenizer, by spec; thread-safe (rank 0 compiles on a worker thread)."""

    def __init__(self, tokenizer, vocab_size: int, max_string: int = 0):
        self.max_string = max_string  # --json-string-max-length (bound_strings)
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
                    # imported on the first grammar, not at every rank's start-up; and not
                    # llguidance.torch, whose import runs torch.compile
                    from llguidance.hf import from_tokenizer

                    self.tok = from_tokenizer(self._hf_tok)
                m = llguidance.LLMatcher(self.tok, grammar_text(spec, self.max_string), log_level=0)
                # the first mask builds the lexer's start states: part of compiling, bounded with it
                words = np.zeros((self.tok.vocab_size + 31) // 32, dtype=np.int32)
                m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
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


class _Batch:
    """Masks of several matchers computed in one call: row i of ``words`` is ``matchers[i]``'s."""

    def __init__(self, matchers: list, tok_vocab: int):
        self.matchers = matchers
        self.words = np.zeros((len(matchers), (tok_vocab + 31) // 32), dtype=np.int32)  # (n, words)
        self.future: Future | None = None  # on the thread
        self.done = np.zeros(len(matchers), dtype=bool)  # computed by MasksAhead.idle, row by row


def masks_on_thread(device: torch.device, ranks_here: int, cores: int) -> bool:
    """Whether a thread should compute masks ahead: only where a core would otherwise idle while it
    works: on a GPU, or on a CPU where torch's threads, times the ``ranks_here`` processes on this host,
    leave one of the ``cores`` free (else the thread contends with the forward passes' OpenMP workers:
    docs/usage/structured-outputs.md, Cost; the last rank then computes them itself, :meth:`MasksAhead.idle`)."""
    if device.type != "cpu":
        return True
    return torch.get_num_threads() * max(1, ranks_here) < cores


class MasksAhead:
    """Next-token masks for the sampling step, computed while the stages compute: on a thread, or where
    no core is free for one (:func:`masks_on_thread`) on the last rank's own thread between passes
    (:meth:`idle`). :meth:`start` queues a row's matcher as soon as the row is fed (or admitted);
    :meth:`flush` sends the queued ones to the thread as one batch (one native llguidance call with the
    GIL dropped: one hand-off per pass, not per row); :meth:`take` returns a micro-batch's masks, those
    never started computed then; :meth:`forget` drops a finished row's. Keyed by matcher object (a row's
    own copy), which each entry holds, so a key is never reused while its computation is pending.
    ``tok_vocab``: the tokenizer's vocabulary size (llguidance's mask width)."""

    def __init__(self, on_thread: bool = True):
        self.on_thread = on_thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks") if on_thread else None
        self._executor: llguidance.LLExecutor | None = None  # the thread's, built there with its first batch
        self._queued: dict[int, object] = {}  # started, not yet flushed (by id)
        self._pending: dict[int, tuple[object, _Batch | None, int]] = {}  # id -> (matcher, its batch, row)
        self.flushed: list[_Batch] = []  # flushed, for :meth:`idle` (no thread)
        self.ahead_seconds = 0.0  # computed ahead: on the thread, or in :meth:`idle`

    def _compute(self, batch: _Batch) -> None:
        t0 = time.perf_counter()
        if self._executor is None:  # one native worker: the cores already run the stages
            self._executor = llguidance.LLExecutor(1)
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(batch.matchers)],
                                               batch.words.ctypes.data, batch.words.shape[1] * 4, len(batch.matchers))
        self.ahead_seconds += time.perf_counter() - t0  # one thread: no race

    def start(self, matcher) -> None:
        """Queue ``matcher``'s next mask (None: nothing to do); the caller leaves the matcher alone until
        :meth:`take`, and calls :meth:`flush` once it has started a pass's rows."""
        if matcher is not None and id(matcher) not in self._pending and not matcher.is_stopped():
            self._pending[id(matcher)] = (matcher, None, 0)
            self._queued[id(matcher)] = matcher

    def flush(self, tok_vocab: int) -> None:
        """Begin computing every queued mask, as one batch on the thread (without one: at :meth:`idle`)."""
        # those neither taken nor forgotten since they were queued
        queued = [m for m in self._queued.values() if self._pending.get(id(m), (None, 0))[1] is None]
        self._queued = {}
        if not queued:
            return
        batch = _Batch(queued, tok_vocab)
        for i, m in enumerate(queued):
            self._pending[id(m)] = (m, batch, i)
        if self.on_thread:
            batch.future = self._pool.submit(self._compute, batch)
        else:
            self.flushed.append(batch)

    def idle(self) -> None:
        """Without a thread: compute the flushed masks now, once the pass's answer has left and before the
        next input is awaited (at P > 1 while the other stages compute). A row forgotten meanwhile is
        skipped; one whose mask raises is left to :meth:`take`."""
        if self.flushed:
            t0 = time.perf_counter()
            self._drain()
            self.ahead_seconds += time.perf_counter() - t0

    def _drain(self) -> None:
        for batch in self.flushed:
            stride = batch.words.shape[1] * 4
            for i, m in enumerate(batch.matchers):
                if self._pending.get(id(m), (None, None))[1] is batch:
                    try:
                        m.unsafe_compute_mask_ptr(batch.words.ctypes.data + i * stride, stride)
                        batch.done[i] = True
                    except Exception:  # computed again at take(), where the error reaches the row
                        pass
        self.flushed = []

    def take(self, matchers: list, tok_vocab: int) -> np.ndarray:
        """(len(matchers), words) int32: each matcher's next mask, the one started ahead (waiting for its
        batch if still running) or else computed now, straight into its row (never started, or started
        but not flushed: a row admitted in this very pass, whose mask nothing could have computed sooner)."""
        self._drain()  # (without a thread: batches flushed since the last idle time, computed now)
        out = np.zeros((len(matchers), (tok_vocab + 31) // 32), dtype=np.int32)
        base, stride = out.ctypes.data, out.shape[1] * 4
        for k, m in enumerate(matchers):
            got = self._pending.pop(id(m), None) if self._pending else None
            batch = got[1] if got is not None else None
            if batch is not None and batch.future is not None:
                try:
                    batch.future.result()  # done for every row of the batch after the first
                    out[k] = batch.words[got[2]]
                    continue
                except Exception:  # the batch failed: this row alone, where an error reaches the row
                    pass
            elif batch is not None and batch.done[got[2]]:
                out[k] = batch.words[got[2]]
                continue
            m.unsafe_compute_mask_ptr(base + k * stride, stride)
        return out

    def forget(self, matcher) -> None:
        """A finished row: its pending mask (if any) is dropped; the matcher is free once its batch ends."""
        if matcher is not None:
            self._pending.pop(id(matcher), None)  # (still queued: flush skips it)


def allowed_mask(matchers: list, eos_ids: set[int], tok_vocab: int, vocab: int,
                 device: torch.device, ahead: MasksAhead | None = None) -> torch.Tensor:
    """(R, vocab) bool: the tokens each row's matcher allows next (a row whose matcher is None: every
    token; ids from ``tok_vocab`` on: none). ``eos_ids`` are allowed exactly where the grammar may end.
    Masks come from ``ahead`` when it started them, unpacked on the host in numpy (a handful of small
    torch ops per row cost more than the masks themselves), then one copy to the device."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    ms = [matchers[i] for i in rows]
    if not ms:
        return torch.ones(len(matchers), vocab, dtype=torch.bool, device=device)
    bm = (ahead or MasksAhead(on_thread=False)).take(ms, tok_vocab)
    bits = np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little")  # (C, words * 32), little-endian words
    n = min(vocab, bits.shape[1])
    cons = np.zeros((len(rows), vocab), dtype=bool)
    cons[:, :n] = bits[:, :n]
    eos = [t for t in sorted(eos_ids) if t < vocab]
    if eos:
        cons[:, eos] = np.array([m.is_accepting() for m in ms], dtype=bool)[:, None]
    if len(rows) == len(matchers):
        return torch.from_numpy(cons).to(device)
    allowed = np.ones((len(matchers), vocab), dtype=bool)
    allowed[rows] = cons
    return torch.from_numpy(allowed).to(device)
