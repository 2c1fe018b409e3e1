"""OpenAI objects from finished candidates (pipeline/output/results.py), by generation: token strings
that join to the text with offsets into it, stop strings cut on text, echo prompts first, chat
logprobs, usage and the two line shapes (the seed's and the Batch API's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.output.results import (Candidate, Detokenizer, IncrementalText, chat_choice, completion_choice,
                                     result_object, top_dict)
from tasks.protocol import output_line
from tests.utils import local_tokenizer

TOK = local_tokenizer()
DETOK = Detokenizer(TOK)
VOCAB = len(TOK)
ids_st = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30)
texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)


def decode(ids):
    return TOK.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@settings(max_examples=60, deadline=None)
@given(text=texts)
def test_pieces_join_to_the_decoded_text(text):
    ids = TOK.encode(text, add_special_tokens=False)
    pieces = DETOK.pieces(ids)
    assert len(pieces) == len(ids) and "".join(pieces) == decode(ids)


@settings(max_examples=60, deadline=None)
@given(ids=ids_st, context=st.lists(st.integers(0, VOCAB - 1), max_size=8))
def test_incremental_text_equals_decoding_the_whole(ids, context):
    inc = IncrementalText(DETOK, context)
    streamed = "".join(inc.add(t) for t in ids)
    pieces = inc.finish()
    assert len(pieces) == len(ids)
    assert streamed == inc.text[: len(streamed)]  # deltas stream a prefix of the final text
    whole = decode(list(context) + ids)[len(decode(list(context))):]
    assert inc.text == "".join(pieces) == whole


@settings(max_examples=60, deadline=None)
@given(ids=ids_st, cut=st.floats(0, 1), top=st.booleans())
def test_completion_choice_offsets_and_stop_cut(ids, cut, top):
    text = decode(ids)
    stop_at = int(cut * len(text))
    lps = [-0.5 - i for i in range(len(ids))]
    tops = [[(t, lp), ((t + 1) % VOCAB, lp - 1)] for t, lp in zip(ids, lps)] if top else None
    cand = Candidate(0, ids=ids, logprobs=lps, top=tops, finish_reason="stop", stop_at=stop_at)
    c = completion_choice(DETOK, cand, 3, 2 if top else None)
    lp = c["logprobs"]
    assert c["text"] == text[:stop_at] and c["index"] == 3 and c["finish_reason"] == "stop"
    assert "".join(lp["tokens"]) == c["text"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) <= len(ids)
    assert lp["token_logprobs"] == lps[: len(lp["tokens"])]
    assert all(c["text"][o:].startswith(p) for o, p in zip(lp["text_offset"], lp["tokens"]))
    if top:
        assert len(lp["top_logprobs"]) == len(lp["tokens"])
    else:
        assert lp["top_logprobs"] is None


def test_echo_puts_the_prompt_first_with_a_null_first_logprob():
    prompt = TOK.encode("Once upon a time", add_special_tokens=False)
    gen = TOK.encode(" there was", add_special_tokens=False)
    echo = {"ids": prompt, "logprobs": [None] + [-1.0] * (len(prompt) - 1),
            "top": [None] + [[(prompt[i], -1.0)] for i in range(1, len(prompt))]}
    cand = Candidate(0, ids=gen, logprobs=[-2.0] * len(gen), top=[[(t, -2.0)] for t in gen])
    c = completion_choice(DETOK, cand, 0, 1, echo=echo)
    lp = c["logprobs"]
    assert c["text"] == decode(prompt + gen)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(prompt) + len(gen) and lp["token_logprobs"][len(prompt)] == -2.0


def test_top_dict_keeps_the_best_logprob_of_tokens_that_print_alike():
    a = TOK.encode(" the", add_special_tokens=False)[0]
    assert top_dict(DETOK, [(a, -3.0), (a, -1.0)]) == {DETOK.token_str(a): -1.0}


@pytest.mark.parametrize("want", [None, 0, 2])
def test_chat_choice_and_its_logprobs(want):
    ids = TOK.encode("Hello there", add_special_tokens=False)
    cand = Candidate(0, ids=ids, logprobs=[-1.0] * len(ids), top=[[(t, -1.0)] for t in ids], finish_reason="length")
    c = chat_choice(DETOK, cand, 0, SimpleNamespace(logprobs=want, return_token_ids=want == 2))
    assert c["message"] == {"role": "assistant", "content": decode(ids)} and c["finish_reason"] == "length"
    assert c.get("token_ids") == (ids if want == 2 else None)
    if want is None:
        assert c["logprobs"] is None
    else:
        content = c["logprobs"]["content"]
        assert "".join(x["token"] for x in content) == decode(ids)
        assert all(x["bytes"] == list(x["token"].encode()) for x in content)
        assert all(len(x["top_logprobs"]) == (1 if want else 0) for x in content)


@pytest.mark.parametrize("kind,obj,prefix", [("chat", "chat.completion", "chatcmpl-"), ("text", "text_completion", "cmpl-")])
def test_result_object_usage(kind, obj, prefix):
    r = result_object(kind, "m", [], 7, 5, 0.1234567, 4, cached_tokens=3)
    assert r["object"] == obj and r["id"].startswith(prefix) and r["model"] == "m"
    assert r["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                          "prompt_tokens_details": {"cached_tokens": 3}}
    assert r["request_time"] == {"batch_time": 0.123457, "batch_size": 4}


def test_output_lines_in_both_shapes():
    err = {"message": "bad", "type": "invalid_request_error", "param": "x"}
    assert output_line({"prompt": "a"}, None, result={"r": 1}) == {"request": {"prompt": "a"}, "result": {"r": 1}}
    assert output_line("raw", None, error=err) == {"request": "raw", "error": err}
    ok = output_line({}, "c1", result={"r": 1})
    assert ok["custom_id"] == "c1" and ok["error"] is None and ok["response"]["status_code"] == 200
    assert ok["response"]["body"] == {"r": 1} and ok["id"].startswith("batch_req_")
    bad = output_line({}, "c2", error=err)
    assert bad["response"] == {"status_code": 400, "request_id": bad["response"]["request_id"], "body": {"error": err}}
    assert bad["error"] == {"code": "invalid_request_error", "message": "bad"}


@settings(max_examples=40, deadline=None)
@given(ids=ids_st, prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), cut=st.floats(0, 1))
def test_token_ids_are_the_ids_of_the_tokens_listed(ids, prompt, cut):
    """return_token_ids: the ids behind logprobs.tokens, the prompt's first with echo, cut with the text."""
    stop_at = int(cut * len(decode(ids)))
    cand = Candidate(0, ids=ids, logprobs=[-1.0] * len(ids), stop_at=stop_at)
    echo = {"ids": prompt, "logprobs": [None] + [-1.0] * (len(prompt) - 1), "top": [None] * len(prompt)}
    c = completion_choice(DETOK, cand, 0, None, echo=echo, token_ids=True)
    assert len(c["token_ids"]) == len(c["logprobs"]["tokens"]) and c["token_ids"][: len(prompt)] == prompt
    assert c["token_ids"] == prompt + ids[: len(c["token_ids"]) - len(prompt)]
    assert "token_ids" not in completion_choice(DETOK, cand, 0, None, echo=echo)
