"""Results out: OpenAI ``text_completion`` / ``chat.completion`` objects and Batch API lines.

Token strings come from incremental detokenization, so joining them reproduces ``text`` exactly
and ``text_offset`` is each token's character offset in ``text`` (a multi-byte character split
over several tokens is attributed to the token that completes it; the others get "").
"""

from __future__ import annotations

import functools
import itertools
import time
import uuid
from dataclasses import dataclass, field

_WINDOW = 6  # tokens of left context when decoding one more token


class Detokenizer:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._single: dict[int, str] = {}
        # Incremental detokenization decodes short windows of ids; prompts that share a prefix (few-shot,
        # multiple choice) repeat the same windows, so their texts are remembered (bounded).
        self.decode = functools.lru_cache(maxsize=1 << 16)(
            lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def pieces(self, ids: list[int], context: list[int] = ()) -> list[str]:
        """Text contributed by each token of ``ids`` (after ``context``), joining to the decoded text."""
        inc = IncrementalText(self, context)
        for t in ids:
            inc.add(t)
        return inc.finish()

    def token_str(self, tid: int) -> str:
        """A single token's string (for top_logprobs keys)."""
        s = self._single.get(tid)
        if s is None:
            s = self._single[tid] = self.tok.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return s


class IncrementalText:
    """Detokenize one token at a time: O(window) work per token, pieces join to the full text."""

    def __init__(self, detok: Detokenizer, context: list[int] = ()):
        self.detok = detok
        self.ids = list(context)[-_WINDOW:]
        self.done = len(self.ids)  # tokens whose text has been emitted
        self.pieces: list[str] = []
        self.text = ""

    def add(self, tid: int) -> str:
        """Append a token; returns the text it completes ("" while a character is incomplete)."""
        self.ids.append(tid)
        a = max(0, self.done - _WINDOW)
        full = self.detok.decode(tuple(self.ids[a:]))
        if full.endswith("\ufffd"):
            self.pieces.append("")
            return ""
        piece = full[len(self.detok.decode(tuple(self.ids[a : self.done]))):]
        self.done = len(self.ids)
        if len(self.ids) > 4 * _WINDOW:  # keep the buffer short
            drop = len(self.ids) - 2 * _WINDOW
            self.ids, self.done = self.ids[drop:], self.done - drop
        self.pieces.append(piece)
        self.text += piece
        return piece

    def finish(self) -> list[str]:
        """Flush a trailing incomplete character into the last piece (as U+FFFD)."""
        if self.done < len(self.ids) and self.pieces:
            a = max(0, self.done - _WINDOW)
            tail = self.detok.decode(tuple(self.ids[a:]))[len(self.detok.decode(tuple(self.ids[a : self.done]))):]
            self.pieces[-1] = tail
            self.text += tail
            self.done = len(self.ids)
        return self.pieces


@dataclass
class Candidate:
    """One generated sequence (a best_of candidate) as the last rank finished it."""

    choice: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] | None = None
    finish_reason: str = "length"
    stop_at: int | None = None  # character index in the generated text where a stop string began
    generated: int = 0  # tokens computed (EOS included), for usage
    pieces: list[str] | None = None  # per-token text from IncrementalText (None: compute here)
    reasoning: object = None  # a reasoning run: its thinking (pipeline.output.reasoning.Thinking)

    @property
    def mean_logprob(self) -> float:
        return sum(self.logprobs) / len(self.logprobs) if self.logprobs else 0.0


def top_dict(detok: Detokenizer, pairs: list[tuple[int, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for tid, lp in pairs:
        key = detok.token_str(tid)
        if key not in out or lp > out[key]:
            out[key] = lp
    return out


def text_offsets(pieces: list[str], start: int = 0) -> list[int]:
    """Where each of ``pieces`` starts in the text they join into (counting from character ``start``)."""
    return list(itertools.accumulate(map(len, pieces[:-1]), initial=start)) if pieces else []


def completion_choice(detok: Detokenizer, cand: Candidate, index: int, want_top: int | None,
                      echo: dict | None = None, token_ids: bool = False, prompt_ids: list[int] | None = None) -> dict:
    """One OpenAI completion choice. ``echo`` = {"ids", "logprobs", "top"} of the prompt (first entry None);
    ``token_ids`` (vLLM's return_token_ids): also the ids of ``logprobs.tokens`` (the prompt's first with
    echo), ``prompt_ids`` as ``prompt_token_ids``, and with top logprobs each position's alternatives by
    id (``top_token_logprobs``: ``[token id, logprob, token text]``, likeliest first; what vLLM's Python
    API reports, where ``top_logprobs`` keys by text and merges tokens of equal text)."""
    echo_ids = echo["ids"] if echo else []
    pieces_prompt = detok.pieces(echo_ids) if echo else []
    pieces_gen = list(cand.pieces) if cand.pieces is not None else detok.pieces(cand.ids, context=echo_ids)
    ids, lps = list(cand.ids), list(cand.logprobs)
    tops = list(cand.top) if cand.top is not None else None
    if cand.stop_at is not None:  # cut text before the stop; keep the tokens that reach into the kept text
        kept, pos = [], 0
        for p in pieces_gen:
            if pos >= cand.stop_at and p:
                break
            kept.append(p[: max(0, cand.stop_at - pos)])
            pos += len(p)
        pieces_gen = kept
        ids, lps = ids[: len(kept)], lps[: len(kept)]
        tops = tops[: len(kept)] if tops is not None else None
    pieces = pieces_prompt + pieces_gen
    text = "".join(pieces)
    token_lps = (list(echo["logprobs"]) if echo else []) + lps
    logprobs = {"tokens": pieces,  # strings that join to `text`
                "token_logprobs": token_lps,
                "top_logprobs": None,
                "text_offset": text_offsets(pieces)}
    if want_top:
        prompt_top = [None if t is None else top_dict(detok, t) for t in echo["top"]] if echo else []
        gen_top = [top_dict(detok, t) for t in (tops or [])]
        logprobs["top_logprobs"] = prompt_top + gen_top
    choice = {"text": text, "index": index, "finish_reason": cand.finish_reason, "logprobs": logprobs}
    if token_ids:
        choice["token_ids"] = list(echo_ids) + ids
        if prompt_ids is not None:
            choice["prompt_token_ids"] = list(prompt_ids)
        if want_top:
            def by_id(pairs):
                return None if pairs is None else [[i, lp, detok.token_str(i)] for i, lp in pairs]
            prompt_top = [by_id(t) for t in echo["top"]] if echo else []
            choice["top_token_logprobs"] = prompt_top + [by_id(t) for t in (tops or [])]
    return choice


def chat_choice(detok: Detokenizer, cand: Candidate, index: int, params) -> dict:
    """One chat.completion choice; logprobs in the chat format when requested."""
    c = completion_choice(detok, cand, index, params.logprobs, token_ids=params.return_token_ids)
    choice = {"index": index, "message": {"role": "assistant", "content": c["text"]},
              "finish_reason": cand.finish_reason, "logprobs": None}
    choice |= {key: c[key] for key in ("token_ids", "top_token_logprobs") if key in c}
    if params.logprobs is not None:
        choice["logprobs"] = chat_logprobs(c["logprobs"])
    return choice


def chat_logprobs(lp: dict) -> dict:
    """Completion-style logprobs (tokens, token_logprobs, top_logprobs) in the chat format."""
    tops = lp["top_logprobs"] or [{}] * len(lp["tokens"])  # (a chat choice has no echoed prompt: no None entry)
    content = [{"token": tok, "logprob": val, "bytes": list(tok.encode()),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top.items()]}
               for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], tops)]
    return {"content": content, "refusal": None}


def result_object(kind: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int,
                  batch_time: float, batch_size: int, cached_tokens: int = 0) -> dict:
    chat = kind == "chat"
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": cached_tokens}},
        "request_time": {"batch_time": round(batch_time, 6), "batch_size": batch_size},
    }


