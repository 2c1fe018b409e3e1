"""A varied structured-outputs request file and its checker (tests/runs/test_structured_runs.py,
bench/structured.py): JSON schemas (nested objects, bounded arrays, enums, string patterns, number
ranges, optional fields, anyOf), regexes, choices and a small grammar (Lark and GBNF)."""

from __future__ import annotations

import json
import re

import jsonschema

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {
              "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
              "age": {"type": "integer", "minimum": 18, "maximum": 99},
              "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
              "address": {"type": "object", "additionalProperties": False, "required": ["zip"],
                          "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                         "floor": {"type": "integer", "minimum": -2, "maximum": 40}}},
              "score": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "null"}]},
              "nick": {"type": "string", "maxLength": 6},
          }}
ITEMS = {"type": "array", "minItems": 2, "maxItems": 4, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}}}
LABEL = {"type": "object", "additionalProperties": False, "required": ["label"],
         "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                        "confidence": {"type": "number", "minimum": 0, "maximum": 1}}}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"
# a schema without a finite instance (r holds an object that must hold r ...): llguidance compiles it, then
# its parser runs out of items at the first token: the request's error, naming its field
ENDLESS = {"$defs": {"d": {"type": "object", "properties": {"r": {"$ref": "#/$defs/d"}}, "required": ["r"]}},
           "type": "object", "properties": {"r": {"$ref": "#/$defs/d"}}, "required": ["r"], "additionalProperties": False}
CHOICES = ["yes", "no", "maybe"]
LARK = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[0-9]{1,2}/\n'
GBNF = 'root ::= "[" item ("," item){0,2} "]"\nitem ::= [a-c]{1,3}\n'
LARK_RE = re.compile(r"^(\d{1,2}|\(.*\))$")  # checked fully by parse_arith below
GBNF_RE = re.compile(r"^\[[a-c]{1,3}(,[a-c]{1,3}){0,2}\]$")


def cases() -> list[tuple[dict, str]]:
    """(request fields, checker name): the constraint of each line."""
    return [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}}, "person"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "items", "schema": ITEMS}}}, "items"),
        ({"structured_outputs": {"json": LABEL}}, "label"),
        ({"response_format": {"type": "json_object"}}, "object"),
        ({"structured_outputs": {"regex": DATE}}, "date"),
        ({"structured_outputs": {"regex": EMAIL}}, "email"),
        ({"structured_outputs": {"choice": CHOICES}}, "choice"),
        ({"structured_outputs": {"grammar": LARK}}, "lark"),
        ({"structured_outputs": {"grammar": GBNF}}, "gbnf"),
    ]


def parse_arith(s: str) -> bool:
    """Whether ``s`` is a sentence of LARK (NUM | "(" expr OP expr ")")."""
    def expr(i: int) -> int:
        m = re.match(r"[0-9]{1,2}", s[i:])
        if m and not s[i:].startswith("("):
            return i + m.end()
        if s[i : i + 1] != "(":
            raise ValueError
        j = expr(i + 1)
        if s[j : j + 1] not in ("+", "*"):
            raise ValueError
        k = expr(j + 1)
        if s[k : k + 1] != ")":
            raise ValueError
        return k + 1
    try:
        return expr(0) == len(s)
    except (ValueError, RecursionError):
        return False


def check(kind: str, text: str) -> None:
    """Raise unless ``text`` satisfies the constraint ``kind`` (a name from :func:`cases`)."""
    schemas = {"person": PERSON, "items": ITEMS, "label": LABEL, "object": {"type": "object"}}
    if kind in schemas:
        jsonschema.validate(json.loads(text), schemas[kind])
    elif kind in ("date", "email"):
        assert re.fullmatch(DATE if kind == "date" else EMAIL, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "lark":
        assert parse_arith(text), text
    elif kind == "gbnf":
        assert GBNF_RE.fullmatch(text), text
    else:
        raise AssertionError(kind)


def request_lines(free: int = 1, max_tokens: int = 80, chat: bool = False, **extra) -> list[tuple[dict, str | None]]:
    """Every case as a request line (completion, or chat with messages), then ``free`` unconstrained
    lines; each with its checker (None: free). ``extra``: more fields for every line."""
    out = []
    for i, (fields, kind) in enumerate(cases()):
        body = {"max_tokens": max_tokens, **fields, **extra}
        body.update({"messages": [{"role": "user", "content": f"Give me {kind} number {i}"}]} if chat
                    else {"prompt": f"Request {i}: answer as {kind}:"})
        out.append((body, kind))
    for i in range(free):
        body = {"max_tokens": 12, **extra}
        body.update({"messages": [{"role": "user", "content": f"free {i}"}]} if chat else {"prompt": f"free text {i}"})
        out.append((body, None))
    return out
