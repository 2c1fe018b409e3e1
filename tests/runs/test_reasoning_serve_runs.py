"""Reasoning over HTTP with the `openai` client, on the shared in-process "default" server at P = 2 (the
default model thinks when its template is asked to: ``chat_template_kwargs: {"enable_thinking": true}``; a key
of its own per test): the reasoning streamed in ``delta.reasoning_content`` apart from the answer's
``delta.content``, the chunks joining to the non-streamed message, usage's reasoning_tokens in the stream's
usage chunk, a budget's forced end, and a starved stream flagged in its last chunk (a stream is never run
again: its text went out)."""

from __future__ import annotations

import json

import pytest

THINK = {"chat_template_kwargs": {"enable_thinking": True}}
SUM = [{"role": "user", "content": "What is 12 + 7?"}]
NAME = "tiny-llama-default"  # the served name: the folder's
PATH = [{"role": "user", "content": "Passage: The kitchen is north of the hallway.\nThe garden is west of the kitchen.\n"
                                    "Question: How do you go from the hallway to the garden?"}]


@pytest.fixture(scope="module")
def server(servers):
    return servers.get("default", 2)


@pytest.fixture
def client(server):
    return server.client(server.key())


def streamed(client, **kw) -> tuple[str, str, list, dict | None]:
    """(reasoning, content, finish chunks' choices, usage) of a streamed chat completion."""
    reasoning, content, last, usage = "", "", [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            if c.finish_reason is not None:
                last.append(c)
    return reasoning, content, last, usage


@pytest.mark.parametrize("extra", [{}, {"thinking_token_budget": 3}, {"reasoning_effort": "low"}],
                         ids=["free", "budget", "effort"])
def test_streamed_reasoning_apart_and_whole(client, extra):
    for messages in (SUM, PATH):
        kw = dict(model=NAME, messages=messages, max_tokens=40, temperature=0, extra_body={**THINK, **extra})
        whole = client.chat.completions.create(**kw)
        msg = whole.choices[0].message
        reasoning, content, last, usage = streamed(client, **kw)
        assert msg.reasoning_content is not None and (reasoning, content) == (msg.reasoning_content, msg.content)
        assert "</think>" not in content + reasoning and "<think>" not in content
        details = whole.usage.completion_tokens_details
        assert details.reasoning_tokens > 0 and usage["completion_tokens_details"]["reasoning_tokens"] == \
            details.reasoning_tokens
        if extra:  # the forced end: the thinking within its budget, an answer after it
            budget = extra.get("thinking_token_budget", 40 // 4)
            assert details.reasoning_tokens <= budget + 8  # the model's own, then "\n</think>\n\n" (8 tokens here)
            assert whole.choices[0].finish_reason == "stop" or content


def test_starved_stream_is_flagged_not_rerun(client):
    kw = dict(model=NAME, messages=PATH, max_tokens=4, temperature=0, extra_body=THINK)
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].message.content == ""
    assert whole.choices[0].model_extra["starved"] == "thinking_unfinished"
    reasoning, content, last, usage = streamed(client, **kw)
    assert content == "" and reasoning == whole.choices[0].message.reasoning_content
    assert last[0].finish_reason == "length" and last[0].model_extra["starved"] == "thinking_unfinished"


def test_without_thinking_nothing_changes(client):
    """No enable_thinking: the default model's template does not open a thinking; the answer is all content."""
    r = client.chat.completions.create(model=NAME, messages=SUM, max_tokens=6, temperature=0)
    assert r.choices[0].message.reasoning_content is None and r.usage.completion_tokens_details is None
    c = client.completions.create(model=NAME, prompt="Q: 12 + 7 =", max_tokens=3, temperature=0)
    assert c.choices[0].text.startswith(" 19")


def test_grammar_after_a_thinking_that_ends_by_itself(client):
    """The default model ends its own thinking; a choice, and a JSON schema (response_format, streamed too),
    apply to the answer after it, the reasoning free."""
    r = client.chat.completions.create(model=NAME, messages=PATH, max_tokens=40, temperature=0,
                                       extra_body={**THINK, "structured_outputs": {"choice": [" north west", " south east"]}})
    msg = r.choices[0].message
    assert msg.content == " north west" and msg.reasoning_content.endswith("Answer: north west")
    schema = {"type": "object", "properties": {"way": {"type": "string", "enum": ["north west", "south east"]}},
              "required": ["way"], "additionalProperties": False}
    kw = dict(model=NAME, messages=PATH, max_tokens=60, temperature=0, extra_body=THINK,
              response_format={"type": "json_schema", "json_schema": {"name": "way", "schema": schema}})
    whole = client.chat.completions.create(**kw)
    assert json.loads(whole.choices[0].message.content)["way"] in ("north west", "south east")
    assert whole.choices[0].message.reasoning_content.startswith("Question: How do you go from the hallway")
    reasoning, content, _, _ = streamed(client, **kw)
    assert (reasoning, content) == (whole.choices[0].message.reasoning_content, whole.choices[0].message.content)
