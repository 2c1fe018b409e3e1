"""Result objects of the Python API, built from the runner's output lines (the same lines file mode writes).

A :class:`Result` per request, in input order: its choices (:class:`Choice`: text, finish reason,
tokens, token logprobs, top logprobs, text offsets, token ids), usage and cached prompt tokens, the
OpenAI result object it came from (``raw``) and, for a request that could not run, ``error`` (the
error object file mode writes in its place). :class:`Score` is :meth:`LLM.score`'s answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class RequestFailed(ValueError):
    """A request's error (``raise_errors=True``); ``error`` is its error object, ``index`` its position."""

    def __init__(self, index: int, error: dict):
        super().__init__(f"request {index}: {error.get('message')}")
        self.index, self.error = index, error


@dataclass
class Choice:
    """One generated sequence (OpenAI's choice)."""

    index: int
    text: str
    finish_reason: str | None
    tokens: list[str] | None = None  # token strings that join to ``text`` (prompt tokens first with echo)
    token_logprobs: list[float | None] | None = None  # logprob of each token (the first prompt token's: None)
    top_logprobs: list[dict[str, float] | None] | None = None  # with logprobs=k: the k most likely per position
    text_offset: list[int] | None = None  # where each token starts in ``text``
    token_ids: list[int] | None = None  # ids of ``tokens`` (prompt ids first with echo)
    reasoning_content: str | None = None  # a chat answer of a reasoning model: its thinking, apart from ``text``
    starved: str | None = None  # why the thinking left no answer (finish_reason "length"; docs/usage/reasoning.md)


@dataclass
class Result:
    """One request's answer: ``choices`` (``n`` of them per prompt), or ``error``."""

    index: int  # position in the call's input
    request: object  # the request as sent (the output line's "request")
    choices: list[Choice] = field(default_factory=list)
    usage: dict | None = None  # prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details
    error: dict | None = None  # {"message", "type", "param"} when the request could not run
    raw: dict | None = None  # the OpenAI result object (text_completion or chat.completion)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def text(self) -> str | None:
        """The first choice's text (None for an error)."""
        return self.choices[0].text if self.choices else None

    @property
    def token_ids(self) -> list[int] | None:
        return self.choices[0].token_ids if self.choices else None

    @property
    def reasoning_content(self) -> str | None:
        """The first choice's reasoning (a chat answer of a reasoning model; None otherwise)."""
        return self.choices[0].reasoning_content if self.choices else None

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason if self.choices else None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose keys and values came from the prefix cache."""
        return ((self.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)


@dataclass
class Score:
    """:meth:`LLM.score`'s answer for one text (or a (context, continuation) pair, lm-eval's loglikelihood)."""

    index: int
    logprob: float | None  # sum of the scored tokens' logprobs (the continuation's, or the text's but the first)
    is_greedy: bool | None  # every scored token was the most likely one (lm-eval's second value)
    tokens: list[str] = field(default_factory=list)  # the scored tokens
    token_logprobs: list[float] = field(default_factory=list)
    error: dict | None = None
    result: Result | None = field(default=None, repr=False)  # the whole echo result

    def __iter__(self):  # (logprob, is_greedy), as lm-eval's loglikelihood returns
        return iter((self.logprob, self.is_greedy))


def from_line(index: int, line: dict) -> Result:
    """A Result from an output line ({"request", "result"} or {"request", "error"}; Batch API lines too)."""
    request = line.get("request", line.get("custom_id"))
    body, error = line.get("result"), line.get("error")
    if "response" in line:  # a Batch API line
        body = (line.get("response") or {}).get("body")
        error = (body or {}).get("error") if error else None
    if error is not None or body is None:
        return Result(index, request, error=error or {"message": "no result", "type": "server_error", "param": None})
    return Result(index, request, [choice(c) for c in body.get("choices", [])], body.get("usage"), raw=body)


def from_answer(index: int, request: object, answer) -> Result:
    """A Result from the engine's :class:`~tasks.protocol.Answer` to ``request``."""
    if not answer.ok:
        return Result(index, request, error=answer.error.to_dict())
    body = answer.result
    return Result(index, request, [choice(c) for c in body.get("choices", [])], body.get("usage"), raw=body)


def error_result(index: int, request: object, error: dict) -> Result:
    return Result(index, request, error=error)


def choice(c: dict) -> Choice:
    """A Choice from a completion choice or a chat choice (its logprobs in the chat format)."""
    lp = c.get("logprobs")
    if "message" in c:
        text = (c.get("message") or {}).get("content") or ""
        tokens = lps = tops = None
        if lp:
            content = lp.get("content") or []
            tokens = [t["token"] for t in content]
            lps = [t["logprob"] for t in content]
            tops = [{x["token"]: x["logprob"] for x in t.get("top_logprobs") or []} for t in content]
        return Choice(c.get("index", 0), text, c.get("finish_reason"), tokens, lps, tops, None, c.get("token_ids"),
                      (c.get("message") or {}).get("reasoning_content"), c.get("starved"))
    lp = lp or {}
    return Choice(c.get("index", 0), c.get("text", ""), c.get("finish_reason"), lp.get("tokens"),
                  lp.get("token_logprobs"), lp.get("top_logprobs"), lp.get("text_offset"), c.get("token_ids"),
                  starved=c.get("starved"))


def score_of(result: Result, start: int | None) -> Score:
    """Sum the echoed logprobs of the tokens starting at character ``start`` (None: every token but the
    first, which has no logprob); greedy when each scored token is its position's most likely."""
    if not result.ok or not result.choices:
        return Score(result.index, None, None, error=result.error, result=result)
    c = result.choices[0]
    keep = [i for i, off in enumerate(c.text_offset or []) if (start is None and i > 0) or
            (start is not None and off >= start)]
    lps = [c.token_logprobs[i] for i in keep]
    greedy = None
    if c.top_logprobs is not None:
        greedy = all(c.top_logprobs[i] and c.token_logprobs[i] >= max(c.top_logprobs[i].values()) - 1e-6
                     for i in keep)
    total = math.fsum(x for x in lps if x is not None)
    return Score(result.index, total, greedy, [c.tokens[i] for i in keep], lps, result=result)
