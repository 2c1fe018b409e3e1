"""Structured outputs over HTTP with the `openai` client (the shared in-process "default" server at P = 2,
grammars compiled within 10 s; a key of its own per test):
response_format json_schema on chat and completions, `client.chat.completions.parse` with a pydantic
model, structured_outputs through extra_body, streaming of constrained tokens, a schema that cannot
compile (HTTP 400), and a Batch API file of the varied cases."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.serve_cases import batch_bodies, wait_batch
from tests.structured_cases import ENDLESS, LABEL, check, request_lines


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


@pytest.fixture(scope="module")
def server(servers):
    return servers.get("default", 2)


@pytest.fixture
def client(server):
    return server.client(server.key())


@pytest.fixture(scope="module")
def name(server) -> str:
    """The served name: the default model's folder name."""
    return server.client(server.key()).models.list().data[0].id


def test_response_format_parse_and_stream(client, name):
    rf = {"type": "json_schema", "json_schema": {"name": "label", "schema": LABEL, "strict": True}}
    msgs = [{"role": "user", "content": "Classify: I love it"}]
    valid = 0
    for seed in range(4):  # seeded sampling: several tries, every one that stopped must validate
        r = client.chat.completions.create(model=name, messages=msgs, response_format=rf, max_tokens=40,
                                           temperature=0.8, seed=seed)
        if r.choices[0].finish_reason == "stop":
            check("label", r.choices[0].message.content)
            valid += 1
        p = client.chat.completions.parse(model=name, messages=msgs, response_format=Pet, max_tokens=40,
                                          temperature=0.8, seed=seed)
        if p.choices[0].finish_reason == "stop":
            assert isinstance(p.choices[0].message.parsed, Pet)
            valid += 1
    assert valid >= 4
    c = client.completions.create(model=name, prompt="Date:", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]"}})
    assert c.choices[0].finish_reason == "stop"
    check_regex = __import__("re").fullmatch(r"20[0-9]{2}-[01][0-9]", c.choices[0].text)
    assert check_regex, c.choices[0].text
    pieces = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=name, messages=msgs, max_tokens=40, temperature=0, stream=True, response_format=rf)]
    whole = client.chat.completions.create(model=name, messages=msgs, max_tokens=40, temperature=0,
                                           response_format=rf).choices[0]
    assert "".join(pieces) == whole.message.content and len([p for p in pieces if p]) > 1
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        client.chat.completions.create(model=name, messages=msgs, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    with pytest.raises(openai.BadRequestError, match="could not go on") as e:  # compiles, then cannot go on
        client.chat.completions.create(model=name, messages=msgs, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "endless", "schema": ENDLESS}})
    assert e.value.body["param"] == "response_format"
    assert client.chat.completions.create(model=name, messages=msgs, max_tokens=2).choices  # the server goes on


def test_batch_api_file(client):
    cases = request_lines(free=1, max_tokens=48, chat=True, temperature=0)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
             for i, (body, _) in enumerate(cases)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"grammar": "start: nope"}}})
    f = client.files.create(file=("s.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    done = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h").id, timeout=600)
    assert done.status == "completed" and done.request_counts.failed == 1
    out = batch_bodies(client.files.content(done.output_file_id).text)
    assert set(batch_bodies(client.files.content(done.error_file_id).text)) == {"bad"}
    stopped = 0
    for i, (_, kind) in enumerate(cases):
        choice = out[f"r{i}"]["response"]["body"]["choices"][0]
        if kind is not None and choice["finish_reason"] == "stop":
            check(kind, choice["message"]["content"])
            stopped += 1
    assert stopped >= 4
