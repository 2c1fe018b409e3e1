"""Streamed chunks (serve/sse.py) by generation: whatever deltas were sent while a request ran, a
choice's chunks join to exactly the non-streamed text and logprobs, chat deltas open with the role,
usage comes last when asked, and the stream ends with [DONE]."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from serve.sse import DONE, ChunkMaker


def parse(events: list[bytes]) -> list[dict]:
    out = []
    for e in events:
        assert e.startswith(b"data: ") and e.endswith(b"\n\n")
        out.append(None if e == DONE else orjson.loads(e[6:-2]))
    return out


def completion_lp(tokens: list[str]) -> dict:
    return {"tokens": tokens, "token_logprobs": [-1.0 - i for i in range(len(tokens))],
            "top_logprobs": None, "text_offset": [sum(map(len, tokens[:i])) for i in range(len(tokens))]}


@settings(max_examples=80, deadline=None)
@given(tokens=st.lists(st.text(max_size=4), min_size=1, max_size=12), streamed=st.integers(0, 12),
       chat=st.booleans(), usage=st.booleans(), with_lp=st.booleans())
def test_chunks_join_to_the_final_text_and_logprobs(tokens, streamed, chat, usage, with_lp):
    streamed = min(streamed, len(tokens))
    text = "".join(tokens)
    lp = completion_lp(tokens) if with_lp else None
    maker = ChunkMaker(chat, "m", "id1", 123)
    one = lambda i: {k: (v[i:i + 1] if v else v) for k, v in lp.items()}  # token i's logprobs, as the head sends
    events = [maker.delta(0, tok, one(i) if with_lp else None) for i, tok in enumerate(tokens[:streamed])]
    if chat:
        lp_final = None
        if with_lp:
            lp_final = {"content": [{"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
                                    for t, v in zip(lp["tokens"], lp["token_logprobs"])], "refusal": None}
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                  "logprobs": lp_final}
    else:
        choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": lp}
    result = {"choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": len(tokens), "total_tokens": 1 + len(tokens)}}
    events += maker.final(result, usage)
    objs = parse(events)
    assert objs[-1] is None  # [DONE]
    chunks = objs[:-1]
    if usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == result["usage"]
        chunks = chunks[:-1]
    assert all(c["id"] == "id1" and c["model"] == "m" and c["created"] == 123 for c in chunks)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
    choices = [c["choices"][0] for c in chunks]
    if chat:
        assert choices[0]["delta"]["role"] == "assistant" and all("role" not in c["delta"] for c in choices[1:])
        assert "".join(c["delta"]["content"] for c in choices) == text
    else:
        assert "".join(c["text"] for c in choices) == text
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["stop"]
    if with_lp:
        if chat:
            got = [x["logprob"] for c in choices if c["logprobs"] for x in c["logprobs"]["content"]]
        else:
            got = [v for c in choices if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
        assert got == lp["token_logprobs"]
