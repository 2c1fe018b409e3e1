"""The engine's answers -> Result objects; echo logprobs -> scores."""

from python_api.llm import _as_list, _request
from python_api.params import SamplingParams
from python_api.outputs import from_answer, score_of
from tasks.protocol import Answer, RequestError

LINE = {"request": {"prompt": "ab"}, "result": {
    "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
    "choices": [{"text": "ab c", "index": 0, "finish_reason": "length",
                 "logprobs": {"tokens": ["a", "b", " c"], "token_logprobs": [None, -1.0, -0.5],
                              "top_logprobs": [None, {"b": -1.0}, {" d": -0.1}], "text_offset": [0, 1, 2]}}],
    "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3,
              "prompt_tokens_details": {"cached_tokens": 1}}}}


def test_completion_answer():
    r = from_answer(4, LINE["request"], Answer(result=LINE["result"]))
    assert r.ok and r.index == 4 and r.text == "ab c" and r.finish_reason == "length" and r.cached_tokens == 1
    assert r.choices[0].tokens == ["a", "b", " c"] and r.choices[0].top_logprobs[2] == {" d": -0.1}


def test_error_and_chat_answers():
    err = {"message": "bad", "type": "invalid_request_error", "param": "prompt"}
    r = from_answer(0, {}, Answer(error=RequestError("bad", "prompt")))
    assert not r.ok and r.error == err and r.text is None
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop",
                         "logprobs": {"content": [{"token": "hi", "logprob": -0.2, "top_logprobs": [
                             {"token": "hi", "logprob": -0.2}]}]}}], "usage": {}}
    r = from_answer(1, {"messages": [{"role": "user", "content": "x"}]}, Answer(result=chat))
    assert r.ok and r.text == "hi" and r.choices[0].token_logprobs == [-0.2] and r.choices[0].top_logprobs == [{"hi": -0.2}]


def test_scores():
    r = from_answer(0, LINE["request"], Answer(result=LINE["result"]))
    whole = score_of(r, None)
    assert whole.logprob == -1.5 and whole.tokens == ["b", " c"] and whole.is_greedy is False
    cont = score_of(r, 1)  # continuation "b c" starts at character 1
    assert tuple(cont) == (-1.5, False)
    assert tuple(score_of(r, 2)) == (-0.5, False)
    assert score_of(from_answer(0, {}, Answer(error=RequestError("x"))), None).logprob is None


def test_prompt_forms():
    assert _as_list("a") == ["a"] and _as_list([1, 2]) == [[1, 2]] and _as_list(["a", [1]]) == ["a", [1]]
    p = SamplingParams(max_tokens=2)
    assert _request(0, "hi", p, False).params.max_tokens == 2
    assert _request(0, {"prompt": "hi", "max_tokens": 5}, p, False).params.max_tokens == 5  # the row's own field wins
    chat = _request(3, {"messages": [{"role": "user", "content": "x"}]}, p, False)
    assert chat.kind == "chat" and chat.index == 3
    line = _request(0, {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x"}}, p, False)
    assert line.custom_id == "c" and line.params.max_tokens == 2
