"""Request fields in whole runs and on a server, every rank in this process (issue 58): a field the runner does
not know, or does not implement with the value given, is the line's error in file mode (counted by field in
the summary) and a 400 naming it in serve mode; --lenient-fields ignores, logs and counts it. The sampling
fields over HTTP, and vLLM's /tokenize, /detokenize and /tokenizer_info behind the API key."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from tests.servers import LocalServer, httpx
from tests.utils import REPO, read_jsonl, run_local, write_jsonl

FLAGS = ["--no-progress", "--num-threads", "1", "--budget", "4096"]
LINES = [
    {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "engine": "tiny-llama", "user": "u1"},
    {"prompt": "Once upon a time", "max_tokens": 3, "temprature": 0.5},
    {"prompt": "Once upon a time", "max_tokens": 3, "suffix": " end"},
    {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [{"type": "function"}]}},
    {"prompt": "Once upon a time", "max_tokens": 3, "temprature": 0.5, "mirostat": 1},
]


def test_file_mode_refuses_in_the_lines_place_and_counts_by_field(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", LINES)
    strict, lenient = tmp_path / "strict.jsonl", tmp_path / "lenient.jsonl"
    r = run_local([*FLAGS, "--infer-data", src, "--output-path", str(strict)])
    assert r.returncode == 0, r.stderr[-2000:]
    out = read_jsonl(strict)
    assert "result" in out[0]
    assert [line.get("error", {}).get("param") for line in out[1:3]] == ["temprature", "suffix"]
    assert out[3]["response"]["status_code"] == 400 and "tool calling is not supported" in out[3]["error"]["message"]
    assert "'temprature', 'mirostat'" in out[4]["error"]["message"]
    summary = json.loads(Path(str(strict) + ".summary.json").read_text())
    assert summary["error_kinds"] == {"field:temprature": 2, "field:suffix": 1, "field:tools": 1}
    assert "field:temprature: 2" in r.stderr

    r = run_local([*FLAGS, "--infer-data", src, "--output-path", str(lenient), "--lenient-fields"])
    assert r.returncode == 0, r.stderr[-2000:]
    out = read_jsonl(lenient)
    assert all("result" in line or line.get("error") is None for line in out)
    texts = [(line.get("result") or line["response"]["body"])["choices"][0] for line in out]
    assert texts[1]["text"] == texts[0]["text"] == texts[2]["text"]  # ignored: plain greedy text
    summary = json.loads(Path(str(lenient) + ".summary.json").read_text())
    assert summary["ignored_fields"] == {"temprature": 2, "suffix": 1, "tools": 1, "mirostat": 1}
    assert summary["errors"] == 0 and "ignored fields: mirostat: 1" in r.stderr
    assert "request field 'temprature' ignored (--lenient-fields)" in r.stderr


class Client:
    """A shared server (tests/servers.py's "default", keyed) with a key of this module's own."""

    def __init__(self, server: LocalServer, key: str):
        self.server, self.key = server, key

    def url(self, path: str) -> str:
        return self.server.url(path)

    def post(self, path: str, body: dict, key: str | None = None) -> httpx.Response:
        """POST ``body`` with this module's key (``key=""``: none)."""
        key = self.key if key is None else key
        return httpx.post(self.url(path), json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"} if key else {})

    def get(self, path: str, key: str | None = None) -> httpx.Response:
        key = self.key if key is None else key
        return httpx.get(self.url(path), timeout=60, headers={"Authorization": f"Bearer {key}"} if key else {})


@pytest.fixture(scope="module")
def server(servers):
    s = servers.get("default", 1)
    return Client(s, s.key())


def counted(metrics: str, field: str, outcome: str) -> float:
    """dist_infer_request_fields_total{field, outcome} in a /metrics text (0 when absent)."""
    line = next((x for x in metrics.splitlines()
                 if x.startswith(f'dist_infer_request_fields_total{{field="{field}",outcome="{outcome}"}}')), None)
    return float(line.rsplit(" ", 1)[1]) if line else 0.0


def test_serve_mode_answers_400_naming_the_field(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for body, path, param in [
        ({"prompt": "x", "max_tokens": 2, "temprature": 0}, "/v1/completions", "temprature"),
        ({**chat, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
         "/v1/chat/completions", "tools"),
        ({**chat, "messages": [{"role": "wizard", "content": "hi"}]}, "/v1/chat/completions", "messages"),
        ({**chat, "top_logprobs": 3}, "/v1/chat/completions", "top_logprobs"),
        ({"prompt": "x", "stream": True, "best_of": 1, "include_stop_str_in_output": True}, "/v1/completions",
         "include_stop_str_in_output"),
    ]:
        r = server.post(path, body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    assert "tool calling is not supported" in server.post("/v1/chat/completions", {**chat, "tools": [{}]}).text
    ok = server.post("/v1/chat/completions", {**chat, "user": "u", "metadata": {"a": "b"}, "store": False,
                                              "service_tier": "auto", "tools": [], "tool_choice": "none"})
    assert ok.status_code == 200, ok.text
    metrics = server.get("/metrics").text
    # a known field by its name; a name no table knows as "unknown", so clients cannot add series without bound
    assert counted(metrics, "include_stop_str_in_output", "refused") >= 1 and counted(metrics, "unknown", "refused") >= 1
    assert 'field="temprature"' not in metrics


def test_the_openai_sdk_sees_a_bad_request(server):
    import openai

    client = server.server.client(server.key)
    name = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt="x", max_tokens=2, extra_body={"typical_p": 0.5})
    assert "typical_p" in str(e.value)
    c = client.completions.create(model=name, prompt="Once upon a time", max_tokens=6, temperature=0,
                                  extra_body={"min_tokens": 6, "repetition_penalty": 1.3, "min_p": 0.1,
                                              "stop_token_ids": [5], "ignore_eos": False, "top_k": 5})
    assert c.usage.completion_tokens == 6 and c.choices[0].finish_reason == "length"


def test_vllms_tokenizer_routes(server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(REPO / "examples" / "tiny-llama-default")
    assert server.post("/tokenize", {"prompt": "hi"}, key="").status_code == 401
    r = server.post("/tokenize", {"prompt": "Once upon a time", "return_token_strs": True}).json()
    ids = tok("Once upon a time")["input_ids"]
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] > 0
    assert r["token_strs"] == tok.convert_ids_to_tokens(ids)
    name = server.get("/v1/models").json()
    bare = server.post("/tokenize", {"model": name["data"][0]["id"], "prompt": "Once upon a time",
                                     "add_special_tokens": False}).json()
    assert bare["tokens"] == tok("Once upon a time", add_special_tokens=False)["input_ids"] and bare["token_strs"] is None
    messages = [{"role": "user", "content": "Who has the ball?"}]
    chat = server.post("/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Who has"}, {"type": "text", "text": "the ball?"}]}]
    joined = [{"role": "user", "content": "Who has\nthe ball?"}]  # OpenAI's content parts: their text, as vLLM joins it
    assert server.post("/tokenize", {"messages": parts}).json()["tokens"] == tok.apply_chat_template(
        joined, add_generation_prompt=True, tokenize=True)["input_ids"]
    closed = server.post("/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert closed["count"] < chat["count"]
    assert server.post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": tok.decode(ids)}
    for path, body, param, status in [("/detokenize", {"tokens": [10**6]}, "tokens", 400),
                                       ("/tokenize", {"prompt": "x", "truncate": 3}, "truncate", 400),
                                       ("/tokenize", {"prompt": "x", "model": "other"}, "model", 404),
                                       ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages",
                                        400),
                                       ("/tokenize", {"messages": [{"role": "user", "content": [
                                           {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "messages", 400)]:
        got = server.post(path, body)
        assert got.status_code == status and got.json()["error"]["param"] == param, got.text
    info = server.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tok).__name__ and info["chat_template"] == tok.chat_template
    assert server.get("/tokenizer_info", key="").status_code == 401


def test_a_lenient_server_ignores_and_counts(tmp_path):
    from pipeline.loading.default_model import default_model_dir

    s = LocalServer(["--model-name", str(default_model_dir()), "--lenient-fields"], tmp_path, keys=0,
                    name="lenient").start()
    try:
        r = httpx.post(s.url("/v1/completions"), json={"prompt": "Once upon a time", "max_tokens": 3,
                                                       "temperature": 0, "temprature": 0.5, "suffix": "x"}, timeout=120)
        assert r.status_code == 200, r.text
        metrics = httpx.get(s.url("/metrics"), timeout=30).text
        assert counted(metrics, "suffix", "ignored") == 1 and counted(metrics, "unknown", "ignored") == 1
    finally:
        s.stop()


def generated_lines():
    """Request lines carrying every supported field (valid values), some with random unknown fields too."""
    from hypothesis import strategies as st

    from tests import fuzz_requests as gen

    unknown = st.lists(gen.unknown_fields(), max_size=2, unique_by=lambda kv: kv[0]).map(dict)
    line = st.tuples(st.booleans().flatmap(lambda chat: gen.valid_bodies(chat).map(lambda b: (chat, b))), unknown)
    return st.lists(line, min_size=2, max_size=5)


@settings(derandomize=True, database=None, max_examples=4, deadline=None, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.generate))
@given(lines=generated_lines())
def test_generated_lines_with_unknown_fields_in_a_run(tmp_path_factory, lines):
    """Each line with an unknown field is its own error naming one of them and counted by it; under
    --lenient-fields it runs and every unknown field is counted once per line; never dropped silently."""
    folder = tmp_path_factory.mktemp("generated_fields")
    objs = []
    for (chat, body), extra in lines:
        body = {**body, **extra, "max_tokens" if not chat else "max_completion_tokens": 2, "min_tokens": 0}
        objs.append({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body} if chat
                    else body)
    src = write_jsonl(folder / "in.jsonl", objs)
    unknowns = [set(x[1]) for x in lines]
    for lenient in (False, True):
        out = folder / f"out_{lenient}.jsonl"
        r = run_local([*FLAGS, "--infer-data", src, "--output-path", str(out), *(["--lenient-fields"] * lenient)])
        assert r.returncode == 0, r.stderr[-2000:]
        answers = read_jsonl(out)
        summary = json.loads(Path(str(out) + ".summary.json").read_text())
        assert len(answers) == len(objs)
        refused = collections.Counter()
        for names, a in zip(unknowns, answers, strict=True):
            error = a.get("error") if "custom_id" not in a else (a["response"]["body"].get("error"))
            if names and not lenient:
                assert error is not None and error["param"] in names, (names, a)
                refused[f"field:{error['param']}"] += 1
            elif error is not None:  # a valid line may still fail for its own reason (a grammar that cannot go on)
                assert error["param"] not in names and not str(error.get("param")).startswith("field:"), error
        if lenient:
            assert summary["ignored_fields"] == dict(collections.Counter(n for names in unknowns for n in names))
        else:
            assert {k: v for k, v in summary["error_kinds"].items() if k.startswith("field:")} == dict(refused)
            assert summary.get("ignored_fields", {}) == {}
