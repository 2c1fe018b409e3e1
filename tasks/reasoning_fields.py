"""A request's reasoning fields, validated: ``thinking_token_budget``, OpenAI's ``reasoning_effort``
(mapped to a budget: :data:`EFFORT`) and ``chat_template_kwargs`` (passed to the chat template, e.g.
``{"enable_thinking": true}``). What they do on the last rank: pipeline.output.reasoning and
docs/usage/reasoning.md.
"""

from __future__ import annotations

import math

import orjson

from tasks.protocol import RequestError

# reasoning_effort -> the share of max_tokens the thinking may take (the rest is the answer's). OpenAI
# leaves its budgets unsaid; shares of max_tokens fit every model size and always leave the answer room.
# "none" and "minimal" end the thinking at once (a model that thinks by default answers without it).
EFFORT = {"none": 0.0, "minimal": 0.0, "low": 0.25, "medium": 0.5, "high": 0.75}
MAX_KWARGS_BYTES = 16384  # chat_template_kwargs are rendered by the template: kept small


def thinking_budget(body: dict, max_tokens: int) -> int | None:
    """The thinking's token budget: ``thinking_token_budget`` (an integer, 0 or more), else
    ``reasoning_effort``'s share of ``max_tokens`` (:data:`EFFORT`), else None (no budget)."""
    budget, effort = body.get("thinking_token_budget"), body.get("reasoning_effort")
    if effort is not None and (not isinstance(effort, str) or effort not in EFFORT):
        raise RequestError(f"'reasoning_effort' must be one of {', '.join(repr(e) for e in EFFORT)}, got "
                           f"{orjson.dumps(effort).decode()[:40] if _jsonable(effort) else repr(effort)[:40]}",
                           "reasoning_effort")
    if budget is not None:
        if not isinstance(budget, int) or isinstance(budget, bool) or not 0 <= budget <= 2**31 - 1:
            raise RequestError(f"'thinking_token_budget' must be an integer of 0 or more, got {str(budget)[:40]}",
                               "thinking_token_budget")
        return budget
    return None if effort is None else math.floor(EFFORT[effort] * max_tokens)


def template_kwargs(body: dict) -> dict | None:
    """``chat_template_kwargs``: an object of extra variables for the chat template (None: none);
    ``reasoning_effort`` is passed to the template too (gpt-oss's reads it), as vLLM does."""
    kw = body.get("chat_template_kwargs")
    if kw is not None:
        if not isinstance(kw, dict) or not all(isinstance(k, str) for k in kw):
            raise RequestError("'chat_template_kwargs' must be an object of template variables, e.g. "
                               "{\"enable_thinking\": true}", "chat_template_kwargs")
        reserved = {"messages", "add_generation_prompt", "tools", "documents", "tokenize"} & set(kw)
        if reserved:
            raise RequestError(f"'chat_template_kwargs' may not set {sorted(reserved)[0]!r} (the request's own "
                               "fields set it)", "chat_template_kwargs")
        if not _jsonable(kw) or len(orjson.dumps(kw)) > MAX_KWARGS_BYTES:
            raise RequestError(f"'chat_template_kwargs' must be JSON of at most {MAX_KWARGS_BYTES} bytes",
                               "chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if isinstance(effort, str) and (kw is None or "reasoning_effort" not in kw):
        kw = {**(kw or {}), "reasoning_effort": effort}
    return kw or None


def _jsonable(v) -> bool:
    try:
        orjson.dumps(v)
        return True
    except TypeError:
        return False
