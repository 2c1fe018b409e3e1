"""The OpenAI SDK's structured ``.parse()`` example of docs/usage/structured-outputs.md, run as written on the
default model against a server in this process (issue 58): a pydantic model with a plain ``str`` field
finishes with a valid object, because a string without a length of its own is closed by the grammar at
--json-string-max-length characters (and an integer without bounds at 18 digits)."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.utils import REPO

PAGE = REPO / "docs" / "usage" / "structured-outputs.md"
DOCS_URL = "http://127.0.0.1:8000/v1"


def parse_example() -> str:
    """The page's indented code block after the marker that names this test (blank lines inside it kept)."""
    lines = PAGE.read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if "readme-test" in x and "test_structured_parse.py" in x) + 1
    while not lines[start].strip():
        start += 1
    end = start
    while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
        end += 1
    return "\n".join(x[4:] for x in lines[start:end])


@pytest.fixture(scope="module")
def server(servers):
    return servers.get("default", 1)  # keyed: the example's api_key="none" becomes one of its keys


def test_the_documented_parse_example_finishes_on_the_default_model(server):
    code = parse_example()
    assert DOCS_URL in code and "name: str" in code and 'api_key="none"' in code
    code = code.replace(DOCS_URL, server.url("/v1")).replace('api_key="none"', f'api_key="{server.key()}"')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(PAGE), "exec", dont_inherit=True), {"__name__": "__main__"})
    name, kind, age = out.getvalue().strip().rsplit(" ", 2)
    assert kind in ("cat", "dog", "fish") and int(age) >= 0 and name


def test_plain_strings_end_within_the_chats_default_max_tokens(server):
    """Sampled answers to several questions (each request's own stream): every one a valid object."""
    from pydantic import BaseModel

    class Story(BaseModel):
        title: str
        moral: str

    client = server.client(server.key())
    model = client.models.list().data[0].id
    for seed in range(4):
        story = client.chat.completions.parse(model=model, response_format=Story, seed=seed, messages=[
            {"role": "user", "content": "Tell me a story with a title and a moral."}]).choices[0].message.parsed
        assert len(story.title) <= 256 and len(story.moral) <= 256


def test_the_bound_leaves_strings_that_bound_themselves():
    from pipeline.sampling.grammar import bound_strings

    schema = {"type": "object", "properties": {
        "a": {"type": "string"}, "b": {"type": "string", "maxLength": 3}, "c": {"type": "string", "pattern": "x+"},
        "d": {"type": "array", "items": {"type": ["string", "null"]}}, "e": {"enum": ["x"]},
        "f": {"$ref": "#/$defs/g"}, "h": {"type": "string", "minLength": 300}, "i": {"type": "integer"},
        "j": {"type": "integer", "minimum": 0}, "k": {"type": "integer", "exclusiveMaximum": 5}},
        "$defs": {"g": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}
    got = bound_strings(schema, 256)
    p = got["properties"]
    assert p["a"]["maxLength"] == 256 and p["b"]["maxLength"] == 3 and "maxLength" not in p["c"]
    assert p["d"]["items"]["maxLength"] == 256 and p["e"] == {"enum": ["x"]} and p["h"]["maxLength"] == 300
    assert got["$defs"]["g"]["anyOf"][0]["maxLength"] == 256 and "maxLength" not in got["$defs"]["g"]["anyOf"][1]
    assert (p["i"]["minimum"], p["i"]["maximum"], p["j"]["minimum"], p["j"]["maximum"]) == (-(10**18 - 1), 10**18 - 1,
                                                                                          0, 10**18 - 1)
    assert p["k"] == {"type": "integer", "exclusiveMaximum": 5, "minimum": -(10**18 - 1)}
    assert "maxLength" not in schema["properties"]["a"]  # a copy: the request's own schema is untouched
