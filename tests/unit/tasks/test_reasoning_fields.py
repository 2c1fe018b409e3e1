"""A request's reasoning fields (tasks/reasoning_fields.py through tasks.requests): thinking_token_budget,
reasoning_effort as a share of max_tokens, chat_template_kwargs passed to the template; each bad value is
that request's error naming its field."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.protocol import RequestError
from tasks.reasoning_fields import EFFORT
from tasks.requests import parse_body, parse_request

MSG = [{"role": "user", "content": "hi"}]


def test_budget_and_effort():
    assert parse_body({"prompt": "x"}, False).params.thinking_budget is None
    assert parse_body({"prompt": "x", "thinking_token_budget": 0}, False).params.thinking_budget == 0
    assert parse_body({"messages": MSG, "max_tokens": 100, "reasoning_effort": "low"}, True).params.thinking_budget == 25
    assert parse_body({"messages": MSG, "max_completion_tokens": 40, "reasoning_effort": "high"},
                      True).params.thinking_budget == 30
    # an explicit budget wins over the effort
    assert parse_body({"messages": MSG, "reasoning_effort": "low", "thinking_token_budget": 7},
                      True).params.thinking_budget == 7
    assert parse_body({"messages": MSG, "reasoning_effort": "none"}, True).params.thinking_budget == 0


@settings(max_examples=50, deadline=None)
@given(max_tokens=st.integers(0, 10_000), effort=st.sampled_from(sorted(EFFORT)))
def test_effort_leaves_the_answer_room(max_tokens, effort):
    p = parse_body({"messages": MSG, "max_tokens": max_tokens, "reasoning_effort": effort}, True).params
    assert 0 <= p.thinking_budget <= max_tokens and p.thinking_budget <= 0.75 * max_tokens


@pytest.mark.parametrize("body, param", [
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"thinking_token_budget": 1.5}, "thinking_token_budget"),
    ({"thinking_token_budget": True}, "thinking_token_budget"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"x": "y" * 20000}}, "chat_template_kwargs"),
])
def test_bad_fields_are_the_requests_error(body, param):
    with pytest.raises(RequestError) as e:
        parse_body({"messages": MSG, **body}, True)
    assert e.value.param == param and e.value.kind == "invalid_request_error"


def test_template_kwargs_reach_the_request():
    r = parse_body({"messages": MSG, "chat_template_kwargs": {"enable_thinking": True}}, True)
    assert r.template_kwargs == {"enable_thinking": True}
    r = parse_body({"messages": MSG, "reasoning_effort": "medium"}, True)
    assert r.template_kwargs == {"reasoning_effort": "medium"}  # gpt-oss's template reads it, as vLLM passes it
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}}}
    assert parse_request(line, 0).template_kwargs == {"enable_thinking": False}
    assert parse_body({"prompt": "x"}, False).template_kwargs is None
