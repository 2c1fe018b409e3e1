"""No request field is silently ignored (tasks.fields), by generation: a request carrying every field the
runner implements (valid values) plus the fields that change nothing here is taken, and reads each field;
adding unknown fields makes it an error naming one of them, or under --lenient-fields the same request
with those fields listed as ignored; OpenAI's and vLLM's fields without an implementation are taken at
their defaults only."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.fields import DEFAULT_ONLY, NO_EFFECT, TOOLS, check_fields
from tasks.protocol import RequestError
from tasks.requests import parse_body, parse_line, parse_request
from tests import fuzz_requests as gen

FAST = settings(derandomize=True, database=None, max_examples=100, deadline=None,
                suppress_health_check=list(HealthCheck))


@FAST
@given(body=gen.valid_bodies(), chat=st.just(False))
def test_every_supported_field_is_read(body, chat):
    p = parse_body(body, chat).params
    assert p.temperature == 0.0 or p.temperature == pytest.approx(body["temperature"])
    assert (p.min_p, p.repetition_penalty, p.min_tokens, p.ignore_eos) == (
        body["min_p"], body["repetition_penalty"], body["min_tokens"], body["ignore_eos"])
    assert p.stop_token_ids == sorted(set(body["stop_token_ids"]))
    assert p.logit_bias == {int(k): v for k, v in body["logit_bias"].items()}
    constrained = any(k in body for k in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                          "guided_choice", "guided_grammar"))
    assert (p.structured is not None) == constrained or body.get("response_format", {}).get("type") == "text"


@FAST
@given(body=gen.valid_bodies(chat=True))
def test_every_supported_chat_field_is_read(body):
    p = parse_body(body, True).params
    assert p.max_tokens == body["max_completion_tokens"] and p.min_p == body["min_p"]


@FAST
@given(chat=st.booleans(), data=st.data(), unknown=st.lists(gen.unknown_fields(), min_size=1, max_size=3,
                                                             unique_by=lambda kv: kv[0]))
def test_unknown_fields_are_refused_by_name_or_ignored_and_listed(chat, data, unknown):
    body = data.draw(gen.valid_bodies(chat))
    extra = dict(unknown)
    with pytest.raises(RequestError) as e:
        parse_body({**body, **extra}, chat)
    assert e.value.param in extra and e.value.reason == f"field:{e.value.param}" and e.value.status == 400
    assert e.value.param in e.value.message
    lenient = parse_body({**body, **extra}, chat, lenient=True)
    assert set(lenient.ignored) == set(extra)
    assert lenient.params == parse_body(body, chat).params  # ignored: they changed nothing


@FAST
@given(body=gen.bodies(nonfinite=True) | gen.batch_line(nonfinite=True),
       unknown=st.lists(gen.unknown_fields(), min_size=1, max_size=2, unique_by=lambda kv: kv[0]))
def test_no_request_with_an_unknown_field_runs(body, unknown):
    """Whatever else a request holds (generated values of every field, valid or not), one with an unknown
    field never becomes a request to run: it is an error (naming that field when nothing else is wrong)."""
    target = body["body"] if isinstance(body.get("body"), dict) and "custom_id" in body else body
    target.update(dict(unknown))
    try:
        req = parse_request(body, 0)
    except RequestError as e:
        assert e.param is None or e.param in gen.FIELDS + ("stream", "stream_options", "custom_id", "body", "url") \
            or e.param in dict(unknown) or e.param in DEFAULT_ONLY or e.param in TOOLS, e.param
        return
    raise AssertionError(f"a request with {dict(unknown)} ran: {req}")


def test_fields_that_change_nothing_are_accepted_whatever_their_value():
    base = {"prompt": "x", "max_tokens": 2}
    with_them = parse_body({**base, **gen.NO_EFFECT, "priority": 5, "parallel_tool_calls": True}, False)
    assert with_them.params == parse_body(base, False).params and with_them.ignored == []
    assert set(gen.NO_EFFECT) <= NO_EFFECT


@pytest.mark.parametrize("field,default,other", [
    ("suffix", None, "tail"), ("skip_special_tokens", True, False), ("include_stop_str_in_output", False, True),
    ("prompt_logprobs", None, 1), ("bad_words", [], ["x"]), ("allowed_token_ids", None, [1]),
    ("add_special_tokens", True, False), ("use_beam_search", False, True), ("length_penalty", 1.0, 2.0),
    ("chat_template_kwargs", None, {"enable_thinking": True}), ("chat_template", None, "{{ x }}"), ("tools", [], [{"type": "function"}]),
    ("tool_choice", "none", "auto"), ("truncate_prompt_tokens", None, 5),
])
def test_known_fields_without_an_implementation_are_taken_only_at_their_default(field, default, other):
    assert check_fields({"prompt": "x", field: default}, False) == []
    with pytest.raises(RequestError) as e:
        check_fields({"prompt": "x", field: other}, False)
    assert e.value.param == field
    if field in TOOLS:
        assert e.value.message.startswith("tool calling is not supported")
    assert check_fields({"prompt": "x", field: other}, False, lenient=True) == [field]


def test_a_chats_own_defaults():
    assert check_fields({"messages": [], "add_special_tokens": False, "echo": False}, True) == []
    with pytest.raises(RequestError, match="'echo'"):
        check_fields({"messages": [], "echo": True}, True)


def test_openais_refusals():
    with pytest.raises(RequestError) as e:
        parse_body({"messages": [{"role": "wizard", "content": "hi"}]}, True)
    assert e.value.param == "messages" and "'wizard'" in e.value.message
    image = {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}  # was rendered as text: its repr
    for content in ([{"type": "text", "text": "what is this?"}, image], ["hi"]):
        with pytest.raises(RequestError, match="content parts must be text parts") as e:
            parse_body({"messages": [{"role": "user", "content": content}]}, True)
        assert e.value.param == "messages"
    assert parse_body({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, True)
    with pytest.raises(RequestError) as e:
        parse_body({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, True)
    assert e.value.param == "top_logprobs"
    assert parse_body({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2},
                      True).params.logprobs == 2


def test_content_parts_are_their_text_and_other_parts_are_refused():
    """OpenAI's content parts reach the chat template as one text (a template of string content rendered the
    list's Python repr), as vLLM joins them; an image part is the request's error, never dropped."""
    def chat(content):
        return parse_body({"messages": [{"role": "user", "content": content}]}, True).prompts[0]

    assert chat([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == chat("a\nb")
    for parts in ([{"type": "image_url", "image_url": {"url": "data:,"}}], [{"type": "text"}], ["a"]):
        with pytest.raises(RequestError) as e:
            chat(parts)
        assert e.value.param == "messages" and "content parts" in e.value.message


def test_batch_lines_and_request_lines():
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}, "extra": 1}'
    with pytest.raises(RequestError) as e:
        parse_line(line, 0)
    assert e.value.param == "extra"
    assert parse_line(line, 0, lenient=True).ignored == ["extra"]
    with pytest.raises(RequestError) as e:
        parse_line(b'{"prompt": "x", "guided_choice": ["a"], "structured_outputs": {"regex": "a"}}', 0)
    assert e.value.param == "guided_choice"
    assert parse_line(b'{"prompt": "x", "guided_choice": ["a", "b"]}', 0).params.structured == {
        "kind": "choice", "value": ["a", "b"]}
    assert parse_line(b'{"prompt": "x", "structured_outputs": {"json_object": true}}', 0).params.structured == {
        "kind": "json_object", "value": None}
    with pytest.raises(RequestError, match="whitespace_pattern"):
        parse_line(b'{"prompt": "x", "structured_outputs": {"regex": "a", "whitespace_pattern": " "}}', 0)


def test_the_shared_request_files_are_taken_as_they_are():
    """HELM's and lm-eval's extras (engine, request_type, model) in the shared files change nothing."""
    from tests.utils import DATA

    for name in ("babi_fewshot.jsonl", "helm_scoring.jsonl", "mixed_params.jsonl"):
        for i, line in enumerate((DATA / name).read_bytes().splitlines()):
            if line.strip():
                assert parse_line(line, i).ignored == []


def test_reasoning_fields_are_read():
    """thinking_token_budget and reasoning_effort on both endpoints, chat_template_kwargs on chat (a
    completion has no template: there it is taken only empty)."""
    assert check_fields({"prompt": "x", "thinking_token_budget": 8, "reasoning_effort": "low"}, False) == []
    assert check_fields({"messages": [], "reasoning_effort": "high",
                         "chat_template_kwargs": {"enable_thinking": True}}, True) == []
    with pytest.raises(RequestError, match="chat_template_kwargs"):
        check_fields({"prompt": "x", "chat_template_kwargs": {"enable_thinking": True}}, False)
