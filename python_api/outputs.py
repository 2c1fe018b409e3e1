"""Result objects of the Python API, built from the engine's answers (what file mode writes): a
:class:`Result` per request, its :class:`Choice` objects, :class:`Score` for :meth:`LLM.score`. They read
as vLLM's ``RequestOutput`` / ``CompletionOutput`` too (docs/usage/from-vllm.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class RequestFailed(ValueError):
    """A request's error (``raise_errors=True``); ``error`` is its error object, ``index`` its position."""

    def __init__(self, index: int, error: dict):
        super().__init__(f"request {index}: {error.get('message')}")
        self.index, self.error = index, error


@dataclass(frozen=True)
class Logprob:
    """vLLM's ``Logprob``: a token's logprob, its rank among the vocabulary's (1: the likeliest; None where
    the token is not among the top logprobs asked for) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class Choice:
    """One generated sequence (OpenAI's choice; vLLM's CompletionOutput)."""

    index: int
    text: str
    finish_reason: str | None
    tokens: list[str] | None = None  # token strings that join to ``text`` (prompt tokens first with echo)
    token_logprobs: list[float | None] | None = None  # logprob of each token (the first prompt token's: None)
    top_logprobs: list[dict[str, float] | None] | None = None  # with logprobs=k: the k most likely per position
    text_offset: list[int] | None = None  # where each token starts in ``text``
    token_ids: list[int] | None = None  # ids of ``tokens`` (prompt ids first with echo)
    # with logprobs=k and token ids: each position's top alternatives as [id, logprob, text], likeliest first
    top_token_logprobs: list[list | None] | None = field(default=None, repr=False)
    logprobs_asked: int | None = field(default=None, repr=False)  # the request's logprobs (None: not asked)
    stop_reason: int | str | None = None  # vLLM's field; not reported here (None)
    reasoning_content: str | None = None  # a chat answer of a reasoning model: its thinking, apart from ``text``
    starved: str | None = None  # why the thinking left no answer (finish_reason "length"; docs/usage/reasoning.md)

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        """vLLM's form: one ``{token id: Logprob}`` per token of ``token_ids``, the sampled token first, then
        the top alternatives asked for; None when the request did not ask for logprobs."""
        if self.logprobs_asked is None or self.token_ids is None or self.token_logprobs is None:
            return None
        out = []
        tops = self.top_token_logprobs or []
        for j, (tid, lp) in enumerate(zip(self.token_ids, self.token_logprobs, strict=True)):
            top = (tops[j] if j < len(tops) else None) or []
            ranks = {entry[0]: rank for rank, entry in enumerate(top, start=1)}
            entry: dict[int, Logprob] = {}
            if lp is not None:  # the first prompt token of an echo has none
                entry[tid] = Logprob(lp, ranks.get(tid), self.tokens[j] if self.tokens else None)
            for other, value, text in top:
                entry.setdefault(other, Logprob(value, ranks[other], text))
            out.append(entry)
        return out

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the generated tokens' logprobs (vLLM's field; None when logprobs were not asked)."""
        if self.logprobs_asked is None or self.token_logprobs is None:
            return None
        return math.fsum(x for x in self.token_logprobs if x is not None)


@dataclass
class Result:
    """One request's answer: ``choices`` (``n`` of them per prompt), or ``error``."""

    index: int  # position in the call's input
    request: object  # the request as sent (the output line's "request")
    choices: list[Choice] = field(default_factory=list)
    usage: dict | None = None  # prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details
    error: dict | None = None  # {"message", "type", "param"} when the request could not run
    raw: dict | None = None  # the OpenAI result object (text_completion or chat.completion)
    prompt: str | None = None  # vLLM's: the prompt's text (a chat's rendered by its template; None for token ids)
    prompt_token_ids: list[int] | None = None  # vLLM's: the (first) prompt's token ids

    @property
    def ok(self) -> bool:
        return self.error is None

    # -- vLLM's RequestOutput ------------------------------------------------------------------
    @property
    def outputs(self) -> list[Choice]:
        """vLLM's name for the choices (each reads as a CompletionOutput)."""
        return self.choices

    @property
    def request_id(self) -> str:
        return str(self.index)

    @property
    def finished(self) -> bool:
        return True

    @property
    def prompt_logprobs(self) -> None:  # vLLM's prompt_logprobs is refused as a field here: echo scores prompts
        return None

    @property
    def num_cached_tokens(self) -> int:
        return self.cached_tokens

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


def from_answer(index: int, request: object, answer) -> Result:
    """A Result from the engine's :class:`~tasks.protocol.Answer` to ``request``."""
    if not answer.ok:
        return Result(index, request, error=answer.error.to_dict(), prompt=_prompt_text(request))
    body, asked = answer.result, _logprobs_asked(request)
    choices = body.get("choices", [])
    ids = body.get("prompt_token_ids") or next((c.get("prompt_token_ids") for c in choices), None)
    return Result(index, request, [choice(c, asked) for c in choices], body.get("usage"), raw=body,
                  prompt=_prompt_text(request), prompt_token_ids=ids)


def _body(request: object) -> dict:
    if isinstance(request, dict) and isinstance(request.get("body"), dict):  # a Batch API line
        return request["body"]
    return request if isinstance(request, dict) else {}


def _prompt_text(request: object) -> str | None:
    prompt = _body(request).get("prompt")
    return prompt if isinstance(prompt, str) else None


def _logprobs_asked(request: object) -> int | None:
    """The request's logprobs: a completion's ``logprobs``, a chat's ``top_logprobs`` under ``logprobs: true``."""
    body = _body(request)
    if "messages" in body:
        return (body.get("top_logprobs") or 0) if body.get("logprobs") is True else None
    value = body.get("logprobs")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def choice(c: dict, asked: int | None = None) -> Choice:
    """A Choice from a completion choice or a chat choice (its logprobs in the chat format); ``asked``: the
    request's logprobs (vLLM's ``Choice.logprobs`` is None when it asked for none)."""
    lp, message = c.get("logprobs") or {}, c.get("message") or {}
    if "message" in c and lp:  # the chat format's logprobs, as a completion's
        content = lp.get("content") or []
        lp = {"tokens": [t["token"] for t in content], "token_logprobs": [t["logprob"] for t in content],
              "top_logprobs": [{x["token"]: x["logprob"] for x in t.get("top_logprobs") or []} for t in content]}
    text = (message.get("content") or "") if "message" in c else c.get("text", "")
    return Choice(c.get("index", 0), text, c.get("finish_reason"), lp.get("tokens"), lp.get("token_logprobs"),
                  lp.get("top_logprobs"), lp.get("text_offset"), c.get("token_ids"), c.get("top_token_logprobs"),
                  asked, reasoning_content=message.get("reasoning_content"), starved=c.get("starved"))


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
