"""SamplingParams -> request fields, and one parameter object per prompt."""

import pytest

from python_api.params import SamplingParams, fields_of, params_for
from tasks.requests import parse_body, parse_request


def test_only_set_fields_are_sent():
    assert SamplingParams().to_request() == {}
    p = SamplingParams(max_tokens=3, temperature=0, stop="\n", logit_bias={5: 1.5}, extra={"response_format": {"type": "json_object"}})
    assert p.to_request() == {"max_tokens": 3, "temperature": 0, "stop": "\n", "logit_bias": {"5": 1.5},
                              "response_format": {"type": "json_object"}}
    req = parse_request({"prompt": "x", **p.to_request()}, 0)
    assert req.params.max_tokens == 3 and req.params.logit_bias == {5: 1.5} and req.params.stop == ["\n"]


def test_chat_logprobs_and_echo():
    fields = SamplingParams(logprobs=2, echo=True, max_tokens=4).to_request(chat=True)
    assert fields == {"logprobs": True, "top_logprobs": 2, "max_tokens": 4}
    req = parse_body({"messages": [{"role": "user", "content": "hi"}], **fields}, True)
    assert req.params.logprobs == 2


def test_params_for():
    one = SamplingParams(max_tokens=1)
    assert params_for(one, 3) == [one] * 3
    assert params_for([one, None], 2) == [one, None]
    with pytest.raises(ValueError, match="one per prompt"):
        params_for([one], 2)
    assert fields_of({"max_tokens": 2}) == {"max_tokens": 2}
    with pytest.raises(TypeError):
        fields_of(3)
