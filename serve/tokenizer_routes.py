"""vLLM's tokenizer endpoints in its request and response shapes (lm-evaluation-harness asks backends
for them): ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (docs/usage/serve.md).

Under the same checks as ``/v1`` (serve.guard); an unknown field is a 400 naming it, as on ``/v1``, and
``model``, when given, must be a served name. The tokenizer runs on the tokenizing threads
(serve.tokenizing), never on the pipeline's.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from pipeline.scheduling.intake import chat_ids
from tasks.protocol import RequestError
from tasks.requests import bool_field, chat_messages

from serve.responses import error, model_not_found, ok, read_json

TOKENIZE_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
TOKENIZE_CHAT_FIELDS = {"model", "messages", "add_special_tokens", "return_token_strs", "add_generation_prompt",
                        "continue_final_message"}
# vLLM's chat fields taken at their defaults only (a template of one's own, kwargs, tools change the tokens)
TOKENIZE_CHAT_DEFAULTS = {"chat_template": None, "chat_template_kwargs": None, "tools": None,
                          "mm_processor_kwargs": None, "media_io_kwargs": None}


def add_tokenizer_routes(app: FastAPI, state) -> None:
    """The three routes on ``app``; ``state``: serve.endpoints.ServeState (its tokenizing threads, names, window)."""
    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await _answer(state, request, _tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await _answer(state, request, _detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        if state.tokenizing is None:
            return error(503, "no tokenizer on this server", "server_error")
        return ok(await state.tokenizing.call(tokenizer_config))


async def _answer(state, request: Request, handler):
    body = await read_json(request)
    if not isinstance(body, dict):
        return error(400, f"the request body must be a JSON object, got a JSON {type(body).__name__}")
    if body.get("model") not in (None, *state.served):
        return model_not_found(body["model"], state.served)
    if state.tokenizing is None:
        return error(503, "no tokenizer on this server", "server_error")
    return ok(await state.tokenizing.call(handler(body, state)))  # a RequestError: the app's handler answers it


def _known(body: dict, fields: set[str], defaults: dict | None = None) -> None:
    """An unknown field, or a known one away from its default, is the request's error naming it."""
    defaults = defaults or {}
    bad = [k for k in body if k not in fields and not (k in defaults and body[k] in (defaults[k], {}, []))]
    if bad:
        raise RequestError(f"unsupported field{'s' if len(bad) > 1 else ''} {', '.join(repr(k) for k in bad)} for "
                           f"this endpoint (it takes {', '.join(sorted(fields))})", bad[0], reason=f"field:{bad[0]}")


def _tokenize(body: dict, state):
    """Validate a /tokenize body (on the HTTP thread); the tokenizer's work, as a function of the tokenizer."""
    chat = "messages" in body
    if chat == ("prompt" in body):
        raise RequestError("give either 'prompt' (a string) or 'messages' (a chat)", "prompt")
    strs = bool_field(body, "return_token_strs")
    special = bool_field(body, "add_special_tokens", not chat)
    if chat:
        _known(body, TOKENIZE_CHAT_FIELDS, TOKENIZE_CHAT_DEFAULTS)
        messages = chat_messages(body)  # as /v1/chat/completions takes them
        opened = bool_field(body, "add_generation_prompt", True)
        cont = bool_field(body, "continue_final_message")
        if opened and cont and "add_generation_prompt" in body:
            raise RequestError("give 'continue_final_message' or 'add_generation_prompt', not both",
                               "continue_final_message")
        opened = opened and not cont

        def encode(tok):
            ids = chat_ids(tok, messages, None, opened, cont)
            if special:  # vLLM's: the rendered text encoded with the tokenizer's special tokens (BOS) on top
                ids = tok(tok.decode(ids), add_special_tokens=True)["input_ids"]
            return ids
    else:
        _known(body, TOKENIZE_FIELDS)
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise RequestError("'prompt' must be a string", "prompt")

        def encode(tok):
            return list(tok(prompt, add_special_tokens=special)["input_ids"])

    def work(tok):
        ids = [int(t) for t in encode(tok)]
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if strs else None}

    return work


def _detokenize(body: dict, state):
    _known(body, {"model", "tokens"})
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestError("'tokens' must be a list of token ids", "tokens")
    bad = [t for t in ids if not 0 <= t < state.vocab_size] if state.vocab_size else [t for t in ids if t < 0]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{state.vocab_size - 1})", "tokens")
    return lambda tok: {"prompt": tok.decode(ids)}


def tokenizer_config(tok) -> dict:
    """The tokenizer's configuration as tokenizer_config.json holds it (paths left out), JSON only."""
    config = {k: _plain(v) for k, v in (getattr(tok, "init_kwargs", None) or {}).items()
              if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")}
    config["tokenizer_class"] = type(tok).__name__
    template = getattr(tok, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config


def _plain(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "content"):  # an AddedToken
        return value.content
    return str(value)
