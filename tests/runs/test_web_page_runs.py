"""The chat page's HTTP side, on the shared in-process "default" server (a key of its own per test): the page
at / needs no key and comes with its security headers, a foreign Host is refused, and the exact requests the
page sends (its models list, its streamed completions in the plain format and its streamed chat) are answered
as it reads them. The page itself in headless Chromium: tests/integration/test_web_page.py."""

from __future__ import annotations

import json

import pytest

from tests.servers import httpx

PATH_QUESTION = ("The kitchen is north of the hallway.\nThe garden is west of the kitchen.\n"
                 "Question: How do you go from the hallway to the garden?")


@pytest.fixture(scope="module")
def server(servers):
    return servers.get("default", 1)


def page_stream(server, route: str, body: dict, key: str | None) -> tuple[int, str]:
    """POST as the page does (stream: true) and join the deltas as its reader does: (status, text)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    text = ""
    with httpx.stream("POST", server.url(route), content=json.dumps({**body, "stream": True}), headers=headers,
                      timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()["error"]["message"]
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunk = json.loads(line[5:])
                assert "error" not in chunk, chunk
                for c in chunk["choices"]:
                    text += (c["delta"].get("content") or "") if "delta" in c else c["text"]
    return 200, text


def test_page_needs_no_key_and_names_its_policy(server):
    r = httpx.get(server.url("/"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"] and r.headers["cache-control"] == "no-store"
    for element in ('id="model"', 'id="input"', 'id="go"', 'id="key"', 'id="format"', 'id="show"'):
        assert element in r.text, element
    assert httpx.get(server.url("/"), headers={"Host": "evil.example"}).status_code == 403  # DNS rebinding


def test_the_pages_requests(server):
    key = server.key()
    r = httpx.get(server.url("/v1/models"))
    assert r.status_code == 401 and "missing or wrong API key" in r.json()["error"]["message"]  # what the page shows
    models = httpx.get(server.url("/v1/models"), headers={"Authorization": f"Bearer {key}"}).json()["data"]
    assert [m["id"] for m in models] and models[0]["id"].startswith("tiny-llama-default")
    plain = {"model": models[0]["id"], "max_tokens": 6, "temperature": 0, "top_p": 1, "top_k": 0, "stop": ["\n"],
             "prompt": f"Passage: {PATH_QUESTION}\nAnswer:"}
    assert page_stream(server, "/v1/completions", plain, None)[0] == 401
    assert page_stream(server, "/v1/completions", plain, key) == (200, " north west")
    chat = {"max_tokens": 40, "temperature": 0, "top_p": 1, "top_k": 0,
            "messages": [{"role": "user", "content": "Once upon a time"}]}
    status, text = page_stream(server, "/v1/chat/completions", chat, key)
    assert status == 200 and len(text.split()) >= 3, text
