"""Serve mode on what a model can be beyond a float folder, each server in this process (tests/servers.py) with
the flags that load it: a GPTQ int4 checkpoint at P = 2 answers as file mode does on it; LoRA adapters are
listed and answer as HF + peft with them; a hub id (a local hub on 127.0.0.1, no network) is the served name
and answers as the same model given as a folder. File mode's runs of each: tests/integration/
test_quantized_checkpoints.py, test_lora_runs.py, test_hub_download.py."""

from __future__ import annotations

import pytest
from huggingface_hub import constants

from tests import quant_checkpoints as qk
from tests.hub_helpers import COMMIT, HubServer, sharded_llama
from tests.servers import LOG, LocalServer
from tests.unit.pipeline.models.test_lora import _http, llama, make_adapter  # noqa: F401 (the llama fixture)
from tests.utils import hf_greedy, local_tokenizer, read_jsonl, run_inprocess, write_jsonl

SHARED = "the quick brown fox jumps over the lazy dog and runs far away into the woods, " * 2


@pytest.fixture
def server(tmp_path):
    """``server(args, stages=1)``: a keyless server of its own, stopped after the test."""
    started = []

    def start(args: list[str], stages: int = 1) -> LocalServer:
        started.append(LocalServer(args, tmp_path / f"server{len(started)}", stages, keys=0).start())
        return started[-1]

    yield start
    for s in started:
        s.stop()


def test_gptq_checkpoint_answers_as_file_mode(make_llama, server, tmp_path):
    """The server on a GPTQ int4 checkpoint (P = 2) answers /v1/completions with file mode's tokens and logprobs on
    the same checkpoint (P = 1), and names the format in ``model``."""
    base = make_llama(num_hidden_layers=2, seed=5)
    q, _ = qk.gptq(base, tmp_path / "q", tmp_path / "ref", bits=4, group=32)
    texts = ["once upon a time", "in the beginning", SHARED + "then", SHARED + "and so"]
    reqs = [{"prompt": t, "max_tokens": 6, "temperature": 0, "logprobs": 1} for t in texts]
    reqs += [{"prompt": t, "echo": True, "max_tokens": 0, "logprobs": 1} for t in texts[:2]]
    data = write_jsonl(tmp_path / "req.jsonl", reqs)
    assert run_inprocess(["--model-name", q, "--infer-data", data, "--output-path", str(tmp_path / "q.jsonl"),
                          "--no-progress", "--num-threads", "1"]) == 0
    want = read_jsonl(tmp_path / "q.jsonl")
    url = server(["--model-name", q], stages=2).url()
    for body, line in zip(reqs, want, strict=True):
        status, r = _http(url + "/v1/completions", body)
        assert status == 200, r
        assert "gptq-int4" in r["model"], r["model"]
        got, ref = r["choices"][0]["logprobs"], line["result"]["choices"][0]["logprobs"]
        assert got["tokens"] == ref["tokens"]
        assert max(abs(u - v) for u, v in zip(got["token_logprobs"], ref["token_logprobs"], strict=True)
                   if u is not None) < 1e-4


def test_serve_lists_and_runs_adapters(llama, server):  # noqa: F811 (the fixture)
    url = server(["--model-name", llama["model"], "--served-model-name", "base", "--lora", f"a1={llama['a1']}"]).url()
    assert [m["id"] for m in _http(url + "/v1/models")[1]["data"]] == ["base", "a1"]
    prompt = [5, 9, 13, 2, 7, 21]
    body = {"model": "a1", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1}
    status, r = _http(url + "/v1/completions", body)
    assert status == 200 and r["model"] == "a1"
    tok = local_tokenizer()
    ref_t, ref_lp = hf_greedy(llama["ref"][1], prompt, 4)
    assert max(abs(a - b) for a, b in zip(r["choices"][0]["logprobs"]["token_logprobs"], ref_lp, strict=True)) < 1e-4
    assert r["choices"][0]["text"] == tok.decode(ref_t, skip_special_tokens=True)
    status, r = _http(url + "/v1/completions", dict(body, model="a9"))
    assert status == 404 and "'base', 'a1'" in r["error"]["message"]


REPO = "acme/tiny-llama"


def test_serve_takes_a_hub_id(server, monkeypatch, tmp_path):
    """The id is the served name (/v1/models), a request naming it runs the base model (its adapter, a hub id
    too, is listed), its answer is that of the same model given as a folder, and the log says which commit."""
    model = sharded_llama(tmp_path / "tiny")
    adapter = make_adapter(str(model), tmp_path / "sup", ["q_proj", "v_proj"], seed=3)
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    data = write_jsonl(tmp_path / "req.jsonl", [body])
    assert run_inprocess(["--model-name", str(model), "--infer-data", data, "--output-path", str(tmp_path / "f.jsonl"),
                          "--no-progress", "--num-threads", "1"]) == 0
    folder_text = read_jsonl(tmp_path / "f.jsonl")[0]["result"]["choices"][0]["text"]
    repos = {REPO: {"commits": {COMMIT: model}, "refs": {"main": COMMIT}},
             "acme/sup-lora": {"commits": {COMMIT: adapter}, "refs": {"main": COMMIT}}}
    with HubServer(repos) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint())  # HF_ENDPOINT, read when huggingface_hub loads
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            hub.endpoint() + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        mark = LOG.mark()
        started = server(["--model-name", REPO, "--lora", "sup=acme/sup-lora", "--cache-dir", str(tmp_path / "cache"),
                          "--budget", "256"])
        assert [m["id"] for m in _http(started.url("/v1/models"))[1]["data"]] == [REPO, "sup"]
        status, answer = _http(started.url("/v1/completions"), dict(body, model=REPO))
        assert status == 200 and answer["model"] == REPO
        assert answer["choices"][0]["text"] == folder_text
        assert {"config.json", "adapter_config.json"} <= set(hub.gets())  # fetched from the hub, not found elsewhere
        assert f"{REPO} at commit {COMMIT}" in LOG.since(mark)  # the served name is the id; the log says which commit
