"""Which request fields the runner knows, and what it does with each: no field that would change the
answer is silently ignored (the table is docs/usage/formats.md's). Every top-level field of a body is
**read** (implemented), **no effect** (accepted: ``user``, ``metadata``, vLLM's ``priority``, ...),
**default only** (known, not implemented: accepted only at the value whose behaviour is the runner's own,
e.g. ``suffix: null``, ``tools: []``) or **unknown** (refused, as OpenAI refuses an argument it does not know).

A refusal is a :class:`~tasks.protocol.RequestError` naming the field, counted in the run summary as
``field:NAME``; ``--lenient-fields`` ignores, logs and counts such fields instead (``ignored_fields``), as vLLM.
"""

from __future__ import annotations

from tasks.protocol import RequestError

# fields parse_params (tasks.requests) reads, for both endpoints
SAMPLING = frozenset({
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "best_of", "stop", "stop_token_ids", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "return_token_ids", "model", "stream", "stream_options",
    "thinking_token_budget", "reasoning_effort",  # reasoning models (tasks.reasoning_fields)
})
COMPLETION = SAMPLING | {"prompt", "echo", "logprobs"}
CHAT = SAMPLING | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "chat_template_kwargs"}

# accepted whatever their value: they change nothing in the answer here
NO_EFFECT = frozenset({
    # OpenAI: bookkeeping, routing and caching hints
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
    "prediction",  # predicted outputs only speed an answer up
    "parallel_tool_calls",  # only with tools (refused below)
    # the seed runner's and HELM's request files; lm-eval's
    "engine", "request_type",
    # vLLM: scheduling and bookkeeping
    "priority", "request_id", "cache_salt", "guided_decoding_backend",
})

# known, not implemented: accepted only where the value asks for what the runner does anyway
_NONE = (None,)
DEFAULT_ONLY: dict[str, tuple] = {
    "suffix": (None, ""),
    "audio": _NONE, "modalities": (None, ["text"]), "verbosity": _NONE,
    "web_search_options": _NONE,
    # vLLM
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "include_stop_str_in_output": (None, False), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "prompt_logprobs": _NONE, "truncate_prompt_tokens": _NONE, "allowed_token_ids": _NONE,
    "bad_words": (None, []), "logits_processors": (None, []), "return_tokens_as_token_ids": (None, False),
    "guided_whitespace_pattern": _NONE, "structural_tag": _NONE, "kv_transfer_params": _NONE,
    "vllm_xargs": (None, {}), "mm_processor_kwargs": (None, {}), "documents": (None, []),
    "chat_template": _NONE, "chat_template_kwargs": (None, {}),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "detokenize": (None, True), "multi_modal_data": (None, {}),
}
# add_special_tokens and a chat request's echo: the runner's own value differs by endpoint
ENDPOINT_DEFAULT: dict[str, tuple[tuple, tuple]] = {  # field: (completion values, chat values)
    "add_special_tokens": ((None, True), (None, False)),
    "echo": (None, (None, False)),  # a completion's echo is read
}
TOOLS: dict[str, tuple] = {"tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
                           "function_call": (None, "none")}
KNOWN = COMPLETION | CHAT | NO_EFFECT | DEFAULT_ONLY.keys() | ENDPOINT_DEFAULT.keys() | TOOLS.keys()

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's


def check_fields(body: dict, chat: bool, lenient: bool = False) -> list[str]:
    """The fields of ``body`` the runner leaves aside under ``lenient`` (empty: none); without it, the
    first field that would change the answer and is not implemented, or that nobody defines, raises
    :class:`RequestError` naming it (and any others with it)."""
    read = CHAT if chat else COMPLETION
    unknown, unsupported, tools = [], [], []
    for key, value in body.items():
        if key in read or key in NO_EFFECT:
            continue
        if key in TOOLS:
            if not _default(value, TOOLS[key]):
                tools.append(key)
            continue
        if key in ENDPOINT_DEFAULT:
            allowed = ENDPOINT_DEFAULT[key][1 if chat else 0]
            if allowed is not None and not _default(value, allowed):
                unsupported.append(key)
            continue
        if key in DEFAULT_ONLY:
            if not _default(value, DEFAULT_ONLY[key]):
                unsupported.append(key)
            continue
        unknown.append(key)
    ignored = tools + unsupported + unknown
    if not ignored or lenient:
        return ignored
    if tools:
        raise RequestError(f"tool calling is not supported: leave out {_names(tools)} (this runner generates text "
                           "and structured outputs only)", tools[0], reason=f"field:{tools[0]}")
    if unsupported:
        name = unsupported[0]
        raise RequestError(f"{_names(unsupported)} {'is' if len(unsupported) == 1 else 'are'} not supported with the "
                           f"value given ({_show(body[name])}): it would change the answer and this runner does not "
                           "implement it; leave it out (docs/usage/formats.md lists what each field may hold), or "
                           "run with --lenient-fields to ignore such fields", name, reason=f"field:{name}")
    name = unknown[0]
    raise RequestError(f"unrecognized request field{'s' if len(unknown) > 1 else ''} {_names(unknown)}: OpenAI's and "
                       "vLLM's fields are listed in docs/usage/formats.md (a misspelt field would otherwise be "
                       "ignored); run with --lenient-fields to ignore unknown fields", name, reason=f"field:{name}")


def check_batch_line(line: dict, lenient: bool = False) -> list[str]:
    """A Batch API line's own keys (custom_id, method, url, body): the others, as check_fields does."""
    extra = [k for k in line if k not in ("custom_id", "method", "url", "body")]
    if extra and not lenient:
        raise RequestError(f"unrecognized Batch API line field{'s' if len(extra) > 1 else ''} {_names(extra)}: a "
                           "line holds custom_id, method, url and body", extra[0], reason=f"field:{extra[0]}")
    return extra


def check_role(message: dict) -> None:
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise RequestError(f"a message's 'role' must be one of {', '.join(repr(r) for r in CHAT_ROLES)}, got "
                           f"{_show(role)}", "messages")


def _default(value, allowed: tuple) -> bool:
    return any(value == a and type(value) is type(a) or (value is None and a is None) for a in allowed) or (
        isinstance(value, float) and any(isinstance(a, int) and not isinstance(a, bool) and value == a for a in allowed))


def _names(keys: list[str]) -> str:
    return ", ".join(f"'{k}'" for k in keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
