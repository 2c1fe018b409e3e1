"""The runner's JSON error messages (tasks.requests.json_problem): its own words and positions, not
the parser's text, which changes between orjson releases."""

import orjson
import pytest

from tasks.requests import RequestError, json_problem, parse_line


def problem(data: bytes) -> str:
    with pytest.raises(orjson.JSONDecodeError) as e:
        orjson.loads(data)
    return json_problem(data, e.value)


@pytest.mark.parametrize("data, want", [
    (b'{"prompt": "unterminated, max_tokens": 3', "unexpected ':' at column 38"),
    (b"not json at all", "unexpected 'n' at column 1"),
    (b'{"a": 1,}', "unexpected ',' at column 8"),
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
])
def test_json_problem_says_what_and_where(data, want):
    assert problem(data) == want


def test_a_bad_line_gets_the_runners_message():
    with pytest.raises(RequestError) as e:
        parse_line(b'{"prompt": "x", "max_tokens": 3,}\n', 4)
    assert str(e.value) == "the line is not valid JSON: unexpected ',' at column 32"
    assert e.value.param is None and e.value.raw == '{"prompt": "x", "max_tokens": 3,}'
