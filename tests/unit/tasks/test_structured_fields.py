"""Request fields of structured outputs: response_format (OpenAI) and structured_outputs, on completions
and chat, in any line form; a malformed constraint is the line's own error."""

import pytest

from tasks.requests import parse_params, parse_request
from tasks.protocol import RequestError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("chat", [False, True])
def test_response_format_kinds(chat):
    assert parse_params({"response_format": {"type": "text"}}, chat).structured is None
    assert parse_params({"response_format": {"type": "json_object"}}, chat).structured == {"kind": "json_object",
                                                                                           "value": None}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert parse_params({"response_format": rf}, chat).structured == {"kind": "json", "value": SCHEMA}
    assert parse_params({}, chat).structured is None


def test_structured_outputs_kinds():
    for key, value in (("regex", "[0-9]+"), ("choice", ["a", "b"]), ("grammar", 'start: "x"'), ("json", SCHEMA)):
        assert parse_params({"structured_outputs": {key: value}}).structured == {"kind": key, "value": value}
    # a schema given as JSON text (as vLLM's guided_json accepts it) is read
    assert parse_params({"structured_outputs": {"json": '{"type": "string"}'}}).structured["value"] == {"type": "string"}


@pytest.mark.parametrize("body, words", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
    ({"response_format": {"type": "xml"}}, "'response_format' must be"),
    ({"response_format": "json"}, "'response_format' must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema' must be a JSON schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {}}, "exactly one"),
    ({"structured_outputs": {"choice": []}}, "non-empty list"),
    ({"structured_outputs": {"choice": ["a", 3]}}, "non-empty list"),
    ({"structured_outputs": {"regex": ""}}, "non-empty string"),
    ({"structured_outputs": {"json": "{not json"}}, "JSON schema object"),
])
def test_malformed_constraints_are_request_errors(body, words):
    with pytest.raises(RequestError, match=words):
        parse_params(body)


def test_batch_api_chat_line_carries_its_constraint():
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"choice": ["x"]}}}
    assert parse_request(line, 0).params.structured == {"kind": "choice", "value": ["x"]}
