"""The runner's JSON error messages (tasks.requests.json_problem): its own words and positions, not
the parser's text, which changes between orjson releases."""

import orjson
import pytest

from tasks.requests import json_problem, parse_line
from tasks.protocol import RequestError


def problem(data: bytes) -> str:
    with pytest.raises(orjson.JSONDecodeError) as e:
        orjson.loads(data)
    return json_problem(data, e.value)


@pytest.mark.parametrize("data, want", [
    (b'{"prompt": "unterminated, max_tokens": 3', "unexpected ':' at column 38"),
    (b"not json at all", "unexpected 'n' at column 1"),
    (b'{"a": 1,}', "unexpected '}' at column 9"),
    (b'{"a" 1}', "unexpected '1' at column 6"),
    (b'{"a": "\x01"}', "unexpected '\\x01' at column 8"),
    (b'{"\xc3\xa9\xc3\xa9": x}', "unexpected 'x' at column 8"),  # columns count characters, not bytes
    (b'{"a": 1}}', "unexpected '}' after the JSON value at column 9"),
    (b'  {"a": 1} {"b": 2}', "unexpected '{' after the JSON value at column 12"),
    (b'{"a":', "it ends before the JSON value is complete (column 6)"),
    (b'{"a": 1\r\n', "it ends before the JSON value is complete (column 8)"),
    (b'{"a": "x', "it ends before the JSON value is complete (column 9)"),
    (b'{"a":\n  1 x}', "unexpected 'x' at line 2 column 5"),
    (b'{"a":\n  1\n', "it ends before the JSON value is complete (line 2 column 4)"),
    (b'{"a": "\xff"}', "byte 8 is not UTF-8"),
    (b"", "it is empty"),
    (b" \n ", "it is empty"),
    # deeper than Python's parser goes: orjson's own limit and position differ between releases
    (b"[" * 5000, "it nests arrays and objects more than 240 levels deep"),
])
def test_json_problem_says_what_and_where(data, want):
    assert problem(data) == want


def test_a_bad_line_gets_the_runners_message():
    with pytest.raises(RequestError) as e:
        parse_line(b'{"prompt": "x", "max_tokens": 3,}\n', 4)
    assert str(e.value) == "the line is not valid JSON: unexpected '}' at column 33"
    assert e.value.param is None and e.value.raw == '{"prompt": "x", "max_tokens": 3,}'


def test_a_byte_order_mark_before_a_line_is_not_part_of_it():
    """A file saved with a UTF-8 BOM (Notepad, PowerShell) keeps its first request, as split_queries.py
    reads it; the line echoes the request without the mark."""
    req = parse_line(b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 3}\r\n', 0)
    assert req.raw == {"prompt": "x", "max_tokens": 3} and req.prompts == ["x"]


def test_a_request_nested_deeper_than_its_echo_can_be_written_is_refused():
    """orjson reads any nesting but writes 255 levels: a line nested deeper (in its metadata, say) ended the
    whole run when its result line, or at P > 1 the message carrying it, was written. Now it is that line's
    error, echoed as its text; serve mode's bodies and the Python API's requests are refused the same way."""
    from tasks.protocol import output_line
    from tasks.requests import MAX_NESTING, parse_body

    for line in (b'{"prompt": "x", "metadata": {"a": ' + b"[" * 300 + b"]" * 300 + b"}}", b"[" * 5000 + b"]" * 5000):
        with pytest.raises(RequestError, match="levels deep") as e:
            parse_line(line, 0)
        assert e.value.raw == line.decode() and orjson.dumps(output_line(e.value.raw, None, error=e.value.to_dict()))
    value = []
    for _ in range(MAX_NESTING - 2):
        value = [value]
    deep = {"prompt": "x", "metadata": {"a": value}}  # MAX_NESTING + 1 levels
    with pytest.raises(RequestError, match="levels deep"):
        parse_body(deep, False)
    deep["metadata"] = value  # MAX_NESTING levels: taken, and it fits in a message between ranks
    assert orjson.dumps([[[[[[[[[[[parse_body(deep, False).raw]]]]]]]]]]])


def test_a_plain_chat_line_is_told_where_chat_requests_go():
    """A plain line is a completions request: one with ``messages`` hears that chat requests are Batch API
    lines (or /v1/chat/completions), not only that a prompt is missing."""
    with pytest.raises(RequestError) as e:
        parse_line(b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}\n', 0)
    assert e.value.param == "prompt" and '"url": "/v1/chat/completions"' in str(e.value)
    with pytest.raises(RequestError) as e:
        parse_line(b'{"max_tokens": 3}\n', 0)
    assert "chat" not in str(e.value)


def test_python_objects_become_what_a_line_holds():
    """The Python API's requests as a line holds them: big integers as orjson reads them, tuples as lists;
    what JSON cannot carry is that request's error."""
    from tasks.requests import as_json

    assert as_json({"a": (1, [2**64, 2**64 - 1, -(2**63), -(2**63) - 1]), 5: None, "b": float("nan")})["a"] == \
        [1, [float(2**64), 2**64 - 1, -(2**63), float(-(2**63) - 1)]]
    assert as_json({5: True}) == {5: True}  # logit_bias may have integer keys
    for bad in ({"x": object()}, {(1, 2): 3}, {True: 1}, [b"bytes"], {"s": {1, 2}}):
        with pytest.raises(RequestError):
            as_json(bad)
