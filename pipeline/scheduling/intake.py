"""Rank 0's intake helpers: a chat request's prompt ids from the model's chat template, and any failure
while preparing a request turned into that request's error (never the run's)."""

from __future__ import annotations

import orjson

from tasks.protocol import RequestError


def raw_value(line: bytes):
    """What an error line echoes for ``line``: its JSON value, else its text."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return line.decode("utf-8", "replace").rstrip("\r\n")


def few(indices: set[int]) -> str:
    s = sorted(indices)
    return ", ".join(map(str, s[:8])) + (f" and {len(s) - 8} more" if len(s) > 8 else "")


def chat_ids(tok, messages: list[dict], kwargs: dict | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[int]:
    """The prompt ids of a chat request: the model's chat template applied to ``messages`` (with the
    request's ``chat_template_kwargs``, e.g. ``enable_thinking``, as template variables; the assistant's
    turn opened, or, ``continue_final_message``, the last message left open to continue).
    A template that refuses them (``raise_exception``: system messages, turn order, content parts)
    or fails on them becomes the request's error."""
    if not getattr(tok, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template; send /v1/completions requests", "messages")
    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                      **({"continue_final_message": True} if continue_final_message else {}),
                                      **(kwargs or {}))
    except Exception as e:
        raise RequestError(f"the model's chat template cannot render these messages: {template_reason(e)}",
                           "messages", reason="chat_template") from e
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    if not ids:  # e.g. Llama 2's template renders a lone system message as nothing
        raise RequestError("the model's chat template renders these messages as an empty prompt; send a user "
                           "message", "messages", reason="chat_template")
    return [int(t) for t in ids]


def template_reason(e: Exception) -> str:
    """The template author's own words when it called ``raise_exception`` (a bare jinja2
    TemplateError); otherwise only the kind of failure (a library's wording is not ours to pass on)."""
    from jinja2.exceptions import TemplateError  # (jinja2 is a requirement: chat templates)

    if type(e) is TemplateError and str(e):
        return str(e)[:500]
    return f"the template raised {type(e).__name__}"


def as_request_error(e: Exception) -> RequestError:
    """Any failure while preparing a request, as the request's error (a RequestError stays itself)."""
    if isinstance(e, RequestError):
        return e
    return RequestError(f"this request could not be prepared ({type(e).__name__}: {str(e)[:200]})", None,
                        "server_error", reason="internal")
