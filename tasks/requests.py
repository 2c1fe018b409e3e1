"""Request lines in: parse and validate OpenAI completion requests (and Batch API lines).

Validation here needs no model; what needs the tokenizer (token ids in range, context window)
happens when rank 0 tokenizes. Every problem raises :class:`RequestError` with a message that
names the field, so the line gets an error result in its place and the rest of the file runs.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import orjson

from tasks.fields import check_batch_line, check_fields, check_role
from tasks.protocol import RequestError
from tasks.reasoning_fields import template_kwargs, thinking_budget

MAX_N = 128  # n and best_of
MAX_LOGPROBS = 20
MAX_STOPS = 4
MAX_STOP_TOKEN_IDS = 64
MAX_REPETITION_PENALTY = 100.0  # vLLM takes any positive value; beyond this every seen token is simply banned
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_INT = 2**31 - 1  # integer fields (max_tokens, top_k, token ids) travel as int32/int64 on the device
SEED_RANGE = (-(2**63), 2**64 - 1)  # what a 64-bit seed holds (and what the wire encoding, orjson, can write)
# A temperature below this is greedy: logits / T overflows float32 for tiny T (softmax gives NaN);
# vLLM's _SAMPLING_EPS is the same 1e-5.
GREEDY_BELOW = 1e-5
MAX_NESTING = 240  # levels of arrays and objects in a request (see check_nesting)
_TOKEN_ID = re.compile(r"[0-9]+")  # a logit_bias key: ASCII digits (int() would take "+5", " 5", "٥")


@dataclass
class Params:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    n: int = 1
    best_of: int = 1
    logprobs: int | None = None
    echo: bool = False
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's and HF's: over the prompt's and the generated tokens (1: off)
    min_p: float = 0.0  # keep tokens at least min_p x the likeliest one's probability (0: off)
    min_tokens: int = 0  # EOS and stop_token_ids are masked, and stop strings not looked for, before this many
    ignore_eos: bool = False  # EOS does not end the row (it is generated like any token)
    stop_token_ids: list[int] = field(default_factory=list)  # tokens that end the row like EOS
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured: dict | None = None  # structured outputs: {"kind": json|json_object|regex|choice|grammar, "value"}
    return_token_ids: bool = False  # each choice also carries the ids of its tokens (vLLM's field)
    # reasoning models (tasks.reasoning_fields; the last rank's side: pipeline.output.reasoning)
    thinking_budget: int | None = None  # thinking_token_budget, or reasoning_effort's share of max_tokens
    starved_retry: bool = False  # the --retry-starved rerun of a request whose answer the thinking starved

    @property
    def counts_tokens(self) -> bool:
        """The row's generated tokens are counted (penalties over them)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @classmethod
    def from_json(cls, d: dict) -> "Params":
        """From its JSON form (logit_bias keys are strings there)."""
        return cls(**{**d, "logit_bias": {int(k): v for k, v in d["logit_bias"].items()}})


@dataclass
class Request:
    index: int  # position among the file's non-blank lines
    raw: object  # the original JSON value, echoed in the output
    prompts: list  # each a str, a list[int] of token ids, or (chat) a list of messages
    params: Params
    kind: str = "completion"  # completion | chat
    custom_id: str | None = None  # Batch API lines
    stream: bool = False  # serve mode: stream: true
    model: object = None  # the request's "model" (a LoRA adapter's name selects it; see pipeline.scheduling.driver)
    ignored: list[str] = field(default_factory=list)  # --lenient-fields: the fields left aside (tasks.fields)
    template_kwargs: dict | None = None  # chat: chat_template_kwargs (and reasoning_effort) for the template


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _show(v) -> str:
    """A value as the client wrote it (in JSON), cut short, for messages."""
    try:
        return orjson.dumps(v).decode()[:40]
    except TypeError:  # e.g. an integer beyond 64 bits (from the Python API)
        return repr(v)[:40]


def check_nesting(value) -> None:
    """orjson reads any nesting but writes at most 255 levels, and a request is echoed in its result line and
    travels inside the messages between ranks: one nested deeper than MAX_NESTING is refused, not a crash."""
    level = [value]
    for _ in range(MAX_NESTING + 1):  # the arrays and objects of each level, from the top
        level = [v for v in level if isinstance(v, (dict, list))]
        if not level:
            return
        level = [x for v in level for x in (v.values() if isinstance(v, dict) else v)]
    raise RequestError(f"the request nests arrays and objects more than {MAX_NESTING} levels deep", None)


def _int(body: dict, key: str, default, lo: int | None = None, hi: int | None = None, what: str = ""):
    v = body.get(key, default)
    if v is None:
        return default
    if not _is_int(v):
        raise RequestError(f"'{key}' must be an integer, got {_show(v)}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise RequestError(f"'{key}' must be {rng}{what}, got {v}", key)
    if v > MAX_INT:  # what the kernels' int32/int64 arithmetic takes
        raise RequestError(f"'{key}' must be at most {MAX_INT}, got {v}", key)
    return v


def _num(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if not _is_num(v):
        raise RequestError(f"'{key}' must be a number, got {_show(v)}", key)
    if v > hi or v < lo or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise RequestError(f"'{key}' must be in {left}{lo}, {hi}], got {v}", key)
    return float(v) + 0.0  # -0.0 -> 0.0


def _prompts(body: dict) -> list:
    if "prompt" not in body or body["prompt"] is None:
        hint = ("; a body with 'messages' is a chat request: /v1/chat/completions (in a request file, a Batch API "
                "line: {\"custom_id\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\"})"
                if "messages" in body else "")
        raise RequestError("'prompt' is required (a string, a list of strings, or token ids)" + hint, "prompt")
    p = body["prompt"]
    if isinstance(p, str):
        return [p]
    if isinstance(p, list):
        if not p:
            raise RequestError("'prompt' is an empty list", "prompt")
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(_is_int(x) for x in p):  # each id is checked against the model's vocabulary (pipeline.scheduling.driver)
            return [list(p)]
        if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in p):
            return [list(x) for x in p]
    raise RequestError(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of non-empty "
        "lists of token ids", "prompt"
    )


def _stops(body: dict) -> list[str]:
    s = body.get("stop")
    if s is None:
        return []
    if isinstance(s, str):
        s = [s]
    if not isinstance(s, list) or not all(isinstance(x, str) for x in s):
        raise RequestError("'stop' must be a string or a list of strings", "stop")
    if len(s) > MAX_STOPS:
        raise RequestError(f"'stop' has {len(s)} sequences; at most {MAX_STOPS} are allowed", "stop")
    return [x for x in s if x]


def bool_field(body: dict, key: str, default: bool = False) -> bool:
    """A true/false field (absent or null: ``default``); anything else is the request's error naming it."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be true or false", key)
    return value


def _stop_token_ids(body: dict) -> list[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t <= MAX_INT for t in ids):
        raise RequestError("'stop_token_ids' must be a list of token ids (integers, 0 or more)", "stop_token_ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"'stop_token_ids' has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed",
                           "stop_token_ids")
    return sorted(set(ids))


def _logit_bias(body: dict) -> dict[int, float]:
    lb = body.get("logit_bias")
    if lb is None:
        return {}
    if not isinstance(lb, dict):
        raise RequestError("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    out = {}
    for k, v in lb.items():
        key = str(k)[:24]
        if isinstance(k, int) and not isinstance(k, bool):  # the Python API may pass int keys
            k = str(k)
        if not isinstance(k, str) or not _TOKEN_ID.fullmatch(k):
            what = "negative: token ids are 0 or more" if isinstance(k, str) and k[:1] == "-" else "not a token id"
            raise RequestError(f"'logit_bias' key {key!r} is {what} (keys are token ids, written as decimal "
                               "strings)", "logit_bias")
        tok = int(k) if len(k) <= 12 else MAX_INT + 1
        if tok > MAX_INT:
            raise RequestError(f"'logit_bias' key {key!r} is beyond any vocabulary", "logit_bias")
        if not _is_num(v) or not -100 <= v <= 100:
            raise RequestError(f"'logit_bias' value for token {key} must be a number in [-100, 100]", "logit_bias")
        out[tok] = float(v) + 0.0
    return out


def parse_params(body: dict, chat: bool = False) -> Params:
    """Sampling parameters of a completion (or chat completion) body, validated."""
    max_tokens_key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _int(body, max_tokens_key, DEFAULT_MAX_TOKENS if not chat else 256, lo=0)
    n = _int(body, "n", 1, lo=1, hi=MAX_N)
    best_of = _int(body, "best_of", n, lo=1, hi=MAX_N)
    if best_of < n:
        raise RequestError(f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
    if chat:
        want = body.get("logprobs")
        if want is not None and not isinstance(want, bool):
            raise RequestError("'logprobs' must be true or false for chat completions", "logprobs")
        top = _int(body, "top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)
        if body.get("top_logprobs") is not None and want is not True:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = top if want else None
        echo = False
    else:
        logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS, what=" (the documented cap)")
        echo = bool_field(body, "echo")
    return_ids = bool_field(body, "return_token_ids")
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise RequestError(f"'seed' must be an integer between {SEED_RANGE[0]} and {SEED_RANGE[1]}", "seed")
    top_k = _int(body, "top_k", 0, lo=-1)
    temperature = _num(body, "temperature", 1.0, 0.0, 2.0)
    min_tokens = _int(body, "min_tokens", 0, lo=0)
    if min_tokens > max_tokens:
        raise RequestError(f"'min_tokens' ({min_tokens}) must be at most '{max_tokens_key}' ({max_tokens})", "min_tokens")
    return Params(
        max_tokens=max_tokens,
        temperature=temperature if temperature >= GREEDY_BELOW else 0.0,
        top_p=_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(top_k, 0),
        n=n,
        best_of=best_of,
        logprobs=logprobs,
        echo=echo,
        stop=_stops(body),
        seed=seed,
        presence_penalty=_num(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_num(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY, lo_open=True),
        min_p=_num(body, "min_p", 0.0, 0.0, 1.0),
        min_tokens=min_tokens,
        ignore_eos=bool_field(body, "ignore_eos"),
        stop_token_ids=_stop_token_ids(body),
        logit_bias=_logit_bias(body),
        structured=_structured(body),
        return_token_ids=return_ids,
        thinking_budget=thinking_budget(body, max_tokens),
    )


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")
# vLLM's options beside the kind, with the values that ask for what the runner does
STRUCTURED_OPTIONS = {"disable_fallback": (None, True, False), "disable_any_whitespace": (None, True, False),
                      "disable_additional_properties": (None, False), "whitespace_pattern": (None,)}
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def constraint_param(raw: object) -> str:
    """The field a request's output constraint came in (its errors' ``param``): ``response_format``, one
    of vLLM's ``guided_*`` fields, or ``structured_outputs``; ``raw``: the line (a Batch API line's body)."""
    body = raw.get("body", raw) if isinstance(raw, dict) else None
    return next((k for k in ("response_format", *GUIDED) if isinstance(body, dict) and body.get(k) is not None),
                "structured_outputs")


def _structured(body: dict) -> dict | None:
    """The request's output constraint, from ``response_format`` (OpenAI: json_object, json_schema) or
    ``structured_outputs`` (one of regex, choice, grammar (Lark or GBNF), json); None: free text.
    Only its shape is checked here: whether it compiles is pipeline.scheduling.grammars' question."""
    rf, so = body.get("response_format"), body.get("structured_outputs")
    guided = [k for k in GUIDED if body.get(k) is not None]  # vLLM's older fields, each one kind of structured_outputs
    if guided:
        if len(guided) > 1 or so is not None:
            raise RequestError(f"give one of {', '.join(repr(k) for k in (*guided, 'structured_outputs')[:3])}, "
                               "not several: each is an output constraint", guided[0])
        so = {GUIDED[guided[0]]: body[guided[0]]}
    name = guided[0] if guided else "structured_outputs"  # the field the constraint came in
    if rf is not None and so is not None:
        raise RequestError(f"give either 'response_format' or '{name}', not both", name)
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"kind": "json_object", "value": None}
        if kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise RequestError("'response_format.json_schema.schema' must be a JSON schema object",
                                   "response_format")
            return {"kind": "json", "value": schema}
        raise RequestError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                           "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\"}}", "response_format")
    if so is None:
        return None
    if isinstance(so, dict) and so.get("json_object") is True and not any(so.get(k) is not None for k in
                                                                          STRUCTURED_KINDS):
        so = {k: v for k, v in so.items() if k != "json_object"}
        kind_keys = ["json_object"]
    else:
        kind_keys = [k for k in STRUCTURED_KINDS if isinstance(so, dict) and so.get(k) is not None]
    if len(kind_keys) != 1:
        raise RequestError("'structured_outputs' must be an object with exactly one of "
                           "'regex', 'choice', 'grammar', 'json' or 'json_object'", "structured_outputs")
    bad = [k for k, v in so.items() if k not in STRUCTURED_KINDS and not (k in STRUCTURED_OPTIONS and v in
                                                                             STRUCTURED_OPTIONS[k])]
    if bad:
        raise RequestError(f"'structured_outputs.{bad[0]}' is not supported with the value given (this runner takes "
                           "'disable_fallback' and 'disable_any_whitespace'; JSON is always generated compact)",
                           "structured_outputs", reason=f"field:structured_outputs.{bad[0]}")
    if kind_keys == ["json_object"]:
        return {"kind": "json_object", "value": None}
    kind, value = kind_keys[0], so[kind_keys[0]]
    if kind == "json" and isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            value = None
    ok = {"json": isinstance(value, dict), "regex": isinstance(value, str) and value != "",
          "grammar": isinstance(value, str) and value.strip() != "",
          "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) and c for c in value)}[kind]
    if not ok:
        what = {"json": "a JSON schema object", "regex": "a non-empty string", "grammar": "a Lark or GBNF grammar",
                "choice": "a non-empty list of non-empty strings"}[kind]
        where = name if guided else f"structured_outputs.{kind}"
        raise RequestError(f"'{where}' must be {what}", name)
    return {"kind": kind, "value": value}


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", "messages")
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), (str, list)):
            raise RequestError("each message must be an object with a string 'role' and a 'content'", "messages")
        check_role(m)
    return [dict(m, content=_text_parts(m["content"])) if isinstance(m["content"], list) else m for m in msgs]


def _text_parts(parts: list) -> str:
    """OpenAI's content parts as the one text a chat template takes (vLLM joins them so for templates of
    string content): text parts only, this runner takes no images, audio or files."""
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise RequestError("a message's content parts must be text parts {\"type\": \"text\", \"text\": \"...\"} "
                           "(no images, audio or files)", "messages")
    return "\n".join(p["text"] for p in parts)


def parse_request(raw: object, index: int, lenient: bool = False) -> Request:
    """A parsed JSON value -> Request (completion, or a Batch API line of either endpoint). A field the runner
    does not know, or does not implement with the value given, is refused (tasks.fields); ``lenient``
    (--lenient-fields): ignored, and listed in the request's ``ignored``."""
    if not isinstance(raw, dict):
        raise RequestError(f"a request must be a JSON object, got a JSON {type(raw).__name__}", None)
    if "custom_id" not in raw:
        return parse_body(raw, False, index, lenient)
    url = raw.get("url", "/v1/completions")
    if not isinstance(raw["custom_id"], str):
        raise RequestError(f"Batch API line: 'custom_id' must be a string, got {_show(raw['custom_id'])}", "custom_id")
    if not isinstance(raw.get("body"), dict):
        raise RequestError("Batch API line: 'body' must be an object", "body")
    if raw.get("method", "POST") != "POST":  # OpenAI's lines are POSTs of a body
        raise RequestError(f"Batch API line: 'method' must be \"POST\", got {_show(raw['method'])}", "method")
    if url not in ("/v1/completions", "/v1/chat/completions"):
        raise RequestError(f"Batch API line: unsupported url {url!r} (use /v1/completions or /v1/chat/completions)",
                           "url")
    return parse_body(raw["body"], url == "/v1/chat/completions", index, lenient, line=raw)


def parse_body(body: object, chat: bool, index: int = 0, lenient: bool = False, line: dict | None = None) -> Request:
    """Serve mode: the JSON body of ``POST /v1/completions`` (or ``/v1/chat/completions``); a request line;
    ``line``: the Batch API line holding ``body`` (its own keys checked too; the output echoes it)."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got a JSON {type(body).__name__}", None)
    check_nesting(line or body)
    prompts = [chat_messages(body)] if chat else _prompts(body)
    ignored = (check_batch_line(line, lenient) if line is not None else []) + check_fields(body, chat, lenient)
    return Request(index, body if line is None else line, prompts, parse_params(body, chat=chat),
                   "chat" if chat else "completion", None if line is None else line["custom_id"],
                   model=body.get("model"), ignored=ignored, template_kwargs=template_kwargs(body) if chat else None)


def json_problem(data: bytes, e: orjson.JSONDecodeError) -> str:
    """What is wrong with ``data``, which orjson refused, in the runner's words and with the position
    ("column C", or "line L column C" in text of several lines). orjson's text, and where it says the
    problem is, change between releases, so the position is the standard library's parser's (the same
    for every orjson); orjson's only for what the standard library reads (NaN, Infinity)."""
    try:
        doc = data.decode("utf-8")
    except UnicodeDecodeError as u:
        return f"byte {u.start + 1} is not UTF-8"
    text = doc.rstrip()
    if not text.strip():
        return "it is empty"
    pos = e.pos
    try:
        json.loads(doc)
    except json.JSONDecodeError as std:
        pos = len(text) if std.msg.startswith("Unterminated string") else std.pos
    except RecursionError:  # the standard library's parser recurses per level (orjson stops at a depth of its own)
        return f"it nests arrays and objects more than {MAX_NESTING} levels deep"
    except ValueError:
        pass

    def where(pos: int) -> str:
        line, col = doc.count("\n", 0, pos) + 1, pos - doc.rfind("\n", 0, pos)
        return f"line {line} column {col}" if "\n" in text else f"column {col}"

    if pos >= len(text):
        return f"it ends before the JSON value is complete ({where(len(text))})"
    start = len(doc) - len(doc.lstrip())
    try:  # a complete value, then more: e.g. two objects on one line
        after = start + json.JSONDecoder().raw_decode(doc[start:])[1] <= pos
    except (ValueError, RecursionError):
        after = False
    return f"unexpected {doc[pos]!r} {'after the JSON value ' if after else ''}at {where(pos)}"


def as_json(value: object, where: str = "the request"):
    """``value`` as a request file or an HTTP body can hold it (the Python API's requests are plain
    objects): integers beyond orjson's 64-bit range become floats, as orjson reads them from a line;
    tuples become lists; a dict's keys are strings (or integers: logit_bias). Anything else is that
    request's RequestError, not a message the pipeline cannot encode at P > 1."""
    if value is None or isinstance(value, (bool, str, float)):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**64 else float(value)
    if isinstance(value, (list, tuple)):
        return [as_json(x, where) for x in value]
    if isinstance(value, dict):
        bad = next((k for k in value if not isinstance(k, (str, int)) or isinstance(k, bool)), None)
        if bad is not None:
            raise RequestError(f"{where} has a key {bad!r} ({type(bad).__name__}): JSON keys are strings", None)
        return {k: as_json(v, where) for k, v in value.items()}
    raise RequestError(f"{where} holds a {type(value).__name__}, which JSON cannot carry: use strings, numbers, "
                       "booleans, None, lists and dicts", None)


def parse_line(line: bytes, index: int, lenient: bool = False) -> Request:
    """One JSONL line -> Request, or RequestError (its ``raw`` attribute holds what to echo). A UTF-8 byte
    order mark before the line (Windows editors write one at a file's start) is not part of it."""
    line = line.removeprefix(b"\xef\xbb\xbf")
    try:
        raw = orjson.loads(line)
        check_nesting(raw)
    except (orjson.JSONDecodeError, RequestError) as e:  # echoed as its text
        err = RequestError(f"the line is not valid JSON: {json_problem(line, e)}", None) \
            if isinstance(e, orjson.JSONDecodeError) else e
        err.raw = line.decode("utf-8", errors="replace").rstrip("\r\n")
        raise err from None
    try:
        return parse_request(raw, index, lenient)
    except RequestError as e:
        e.raw = raw
        raise
