"""Serve mode (--serve) driven by the `openai` package at P = 1 and P = 2, on the shared in-process "tiny"
servers (tests/servers.py; each test with a key of its own): the same answers as file mode, chat,
streaming with logprobs, errors, 32 concurrent clients, --max-pending, a client that leaves. The Batch API:
test_batch_api.py; stopping and restarting a server: test_serve_restarts.py; SIGTERM and SIGKILL of a
real server: tests/integration/test_serve_processes.py."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from tests.serve_cases import CHAT, NAME, REQUESTS, as_lines
from tests.servers import httpx
from tests.utils import assert_consistent_results


@pytest.fixture(scope="module", params=[1, 2], ids=["P1", "P2"])
def server(request, servers):
    return servers.get("tiny", request.param)


@pytest.fixture
def key(server) -> str:
    return server.key()


def test_health_models_and_auth(server, key):
    assert httpx.get(server.url("/health")).json()["status"] == "ok"
    assert [m.id for m in server.client(key).models.list().data] == [NAME]
    r = httpx.get(server.url("/v1/models"))
    assert r.status_code == 401 and "error" in r.json()
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").models.list()


def test_completions_match_file_mode(server, key, serve_reference):
    client = server.client(key)
    got = [client.completions.create(model=NAME, **r).model_dump(exclude_unset=True) for r in REQUESTS]
    ref = [line["result"] for line in serve_reference[0]]
    for g in got:
        assert g["model"] == NAME and g["object"] == "text_completion"
    keep = ("choices", "usage")
    assert_consistent_results(as_lines([{k: g[k] for k in keep} for g in got]),
                              as_lines([{k: r[k] for k in keep} for r in ref]))
    assert got[2]["choices"][0]["text"] == client.completions.create(model=NAME, **REQUESTS[2]).choices[0].text


def test_chat_and_streaming(server, key, serve_reference):
    client = server.client(key)
    chat = client.chat.completions.create(model=NAME, **CHAT)
    ref_chat = next(line for line in serve_reference[1] if line["custom_id"] == "chat")["response"]["body"]
    assert chat.choices[0].message.content == ref_chat["choices"][0]["message"]["content"]
    assert chat.usage.completion_tokens == ref_chat["usage"]["completion_tokens"]
    for req in (REQUESTS[0], REQUESTS[3], {"prompt": "Streaming", "max_tokens": 30, "temperature": 0}):
        full = client.completions.create(model=NAME, **req)
        chunks = list(client.completions.create(model=NAME, stream=True, stream_options={"include_usage": True}, **req))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full.choices[0].text
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
        if req["max_tokens"] == 30:  # text arrives token by token, not only at the end
            assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 10
    stream = client.chat.completions.create(model=NAME, stream=True, **CHAT)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content


def test_streamed_logprobs(server, key):
    """Each chunk carries the logprobs of the tokens in its delta; joined, they are the non-streamed ones."""
    client = server.client(key)
    req = {"prompt": "Logprobs stream", "max_tokens": 20, "temperature": 0, "logprobs": 2, "stop": ["zz"]}
    full = client.completions.create(model=NAME, **req).choices[0].logprobs
    chunks = [c.choices[0] for c in client.completions.create(model=NAME, stream=True, **req) if c.choices]
    with_lp = [c for c in chunks if c.logprobs and c.logprobs.tokens]
    assert len(with_lp) > 5  # token by token, not only in the last chunk
    for c in with_lp:
        assert "".join(c.logprobs.tokens) == c.text
    joined = {k: sum((getattr(c.logprobs, k) for c in with_lp), []) for k in ("tokens", "text_offset", "top_logprobs")}
    assert joined["tokens"] == full.tokens and joined["text_offset"] == full.text_offset
    assert [sorted(t) for t in joined["top_logprobs"]] == [sorted(t) for t in full.top_logprobs]
    assert sum((c.logprobs.token_logprobs for c in with_lp), []) == pytest.approx(full.token_logprobs, abs=1e-4)
    chat = {**CHAT, "logprobs": True, "top_logprobs": 2}
    ref = client.chat.completions.create(model=NAME, **chat).choices[0].logprobs.content
    got = [t for c in client.chat.completions.create(model=NAME, stream=True, **chat)
           if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in got] == [t.token for t in ref]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in ref], abs=1e-4)
    assert all(len(t.top_logprobs) == 2 for t in got)


def test_bad_requests(server, key):
    h = {"Authorization": f"Bearer {key}"}
    r = httpx.post(server.url("/v1/completions"), content=b'{"prompt": "x"', headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"] == "the body is not valid JSON: it ends before the JSON value is complete (column 15)"
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "x", "temperature": 9}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "x", "model": "other"}, headers=h)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "x" * 300000}, headers=h)
    assert r.status_code == 413  # --max-request-bytes 200000
    for stream in (False, True):  # found when tokenizing, on the pipeline thread
        r = httpx.post(server.url("/v1/completions"), json={"prompt": [10**9], "stream": stream}, headers=h)
        assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    for options, stream in (({"include_usage": True}, False), ({"include_usage": "x"}, True), ("yes", True)):
        r = httpx.post(server.url("/v1/completions"), json={"prompt": "x", "stream": stream,
                                                            "stream_options": options}, headers=h)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("stream_options", "include_usage"), r.text
    r = httpx.get(server.url("/v1/batches?limit=x"), headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text
    assert r.json()["error"]["message"].startswith("invalid 'limit': ")
    r = httpx.get(server.url("/v1/batches/batch_nope"), headers=h)
    assert r.status_code == 404
    with pytest.raises(openai.BadRequestError):
        server.client(key).completions.create(model=NAME, prompt="x", max_tokens=-1)
    assert server.client(key).completions.create(model=NAME, prompt="still alive", max_tokens=2).choices


def test_concurrent_clients(server, key):
    client = server.client(key)
    results, errors = {}, []

    def worker(t: int) -> None:
        try:
            for k in range(2):
                i = 2 * t + k
                r = client.completions.create(model=NAME, prompt=f"Request {i} says", max_tokens=12, seed=i)
                results[i] = r.choices[0].text
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and sorted(results) == list(range(32))
    # seeded requests repeat alone what they answered among 31 others
    assert client.completions.create(model=NAME, prompt="Request 5 says", max_tokens=12, seed=5).choices[0].text == results[5]


def test_too_many_pending(server, key):
    """70 clients at once against --max-pending 40: some wait (200), the others hear 429 with Retry-After."""
    h = {"Authorization": f"Bearer {key}"}
    codes, retry = [], []

    def one() -> None:
        r = httpx.post(server.url("/v1/completions"), json={"prompt": "busy", "max_tokens": 480, "temperature": 0},
                       headers=h, timeout=120)
        codes.append(r.status_code)
        if r.status_code == 429:
            retry.append(r.headers.get("retry-after"))

    threads = [threading.Thread(target=one) for _ in range(70)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
    assert retry[0] == "1"
    assert server.pending() == 0


def test_client_disconnect_frees_rows(server, key):
    h = {"Authorization": f"Bearer {key}"}
    mark = server.log.mark()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), json={"prompt": "leave", "max_tokens": 480, "n": 16},
                   headers=h, timeout=0.3)
    server.log.wait_for("the client left; its rows are freed", mark, 20)
    deadline = time.monotonic() + 20
    while server.pending():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # the server lives on and answers
    assert server.client(key).completions.create(model=NAME, prompt="after", max_tokens=3).choices
