"""Hub ids against a local hub on 127.0.0.1 (tests/hub_helpers.HubServer; huggingface_hub's endpoint and
cache pointed at it and at a temp folder, as HF_ENDPOINT and HF_HUB_CACHE do), in one process
(``--in-process``): a model and an adapter by id at P = 2 give the results of the same model and adapter
given as folders; a rerun on another revision is not taken for finished work; an interrupted download
resumes with a Range request; a gated repository, an unknown one and an unknown revision exit 2 naming
it. Ranks in processes sharing a node's cache, each fetching its own shards: tests/integration/test_hub_download.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hub_helpers import COMMIT, OLD_COMMIT, HubServer, sharded_llama
from tests.utils import read_jsonl, run_local, strip_volatile, write_jsonl

REPO = "acme/tiny-llama"
SHARDS = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
PROMPTS = [{"prompt": p, "max_tokens": 4, "temperature": 0, "logprobs": 2}
           for p in ("The capital of France is", "One, two, three,", "Hello")]
PROMPTS.append({"prompt": "Hello", "max_tokens": 4, "temperature": 0, "logprobs": 2, "model": "sup"})  # the adapter


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return sharded_llama(tmp_path_factory.mktemp("hub-int") / "tiny")


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory):
    from tests.unit.pipeline.models.test_lora import make_adapter

    return Path(make_adapter(str(model), tmp_path_factory.mktemp("hub-lora") / "sup", ["q_proj", "v_proj"], seed=3))


@pytest.fixture
def hub(model, adapter, tmp_path_factory):
    other = sharded_llama(tmp_path_factory.mktemp("hub-int-v1") / "tiny", seed=1)
    repos = {REPO: {"commits": {COMMIT: model, OLD_COMMIT: other}, "refs": {"main": COMMIT, "v1": OLD_COMMIT}},
             "acme/sup-lora": {"commits": {COMMIT: adapter}, "refs": {"main": COMMIT}},
             "acme/gated": {"commits": {COMMIT: model}, "refs": {"main": COMMIT}, "gated": True}}
    with HubServer(repos) as server:
        yield server


def results(path) -> list[dict]:
    out = []
    for line in read_jsonl(path):
        line = strip_volatile(line)
        line["result"].pop("model")  # the folder's name against org/name@commit
        out.append(line)
    return out


@pytest.fixture(scope="module")
def folder_results(model, adapter, tmp_path_factory):
    """The same model and adapter given as folders, P = 2: what every hub run must equal."""
    work = tmp_path_factory.mktemp("hub-folder")
    data = write_jsonl(work / "req.jsonl", PROMPTS)
    r = run_local(["--model-name", str(model), "--lora", f"sup={adapter}", "--infer-data", data, "--budget", "256"], 2)
    assert r.returncode == 0, r.stderr[-3000:]
    return results(work / "output_req.jsonl")


@pytest.fixture
def hub_client(hub, tmp_path, monkeypatch):
    """huggingface_hub of this process pointed at the local hub and a cache of the test's own: what
    HF_ENDPOINT and HF_HUB_CACHE set in a new process."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint())
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        hub.endpoint() + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return hub


def test_ids_at_p2_equal_folders_and_another_revision_is_another_run(hub_client, folder_results, tmp_path):
    data = write_jsonl(tmp_path / "req.jsonl", PROMPTS)
    r = run_local(["--model-name", REPO, "--lora", "sup=acme/sup-lora", "--infer-data", data, "--budget", "256"], 2)
    assert r.returncode == 0, r.stderr[-3000:]
    gets = hub_client.gets()
    assert sorted(gets) == sorted(set(gets)), f"a file was downloaded twice: {gets}"
    assert set(SHARDS) | {"adapter_model.safetensors"} <= set(gets)
    lines = read_jsonl(tmp_path / "output_req.jsonl")
    assert [line["result"]["model"] for line in lines] == [f"{REPO}@{COMMIT}"] * 3 + ["sup"]
    assert results(tmp_path / "output_req.jsonl") == folder_results
    # another revision is another run: its output is not taken for finished work
    r = run_local(["--model-name", f"{REPO}@v1", "--lora", "sup=acme/sup-lora", "--infer-data", data])
    assert r.returncode == 2 and "written by another run" in r.stderr and OLD_COMMIT in r.stderr, r.stderr[-2000:]


def test_interrupted_download_resumes(hub_client, model, monkeypatch):
    """The library writes what it received in chunks of DOWNLOAD_CHUNK_SIZE (10 MiB) and resumes from the
    last whole chunk: small chunks make a resume visible on a tiny shard."""
    from huggingface_hub import constants

    from pipeline.loading.hub import missing_weights, resolve_model

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 256)
    hub_client.cut[SHARDS[2]] = 1000  # the first GET ends after 1000 bytes, the connection closed
    source = resolve_model(REPO)
    missing_weights(source)
    assert source.fetch(SHARDS[2])
    assert (source.folder / SHARDS[2]).read_bytes() == (model / SHARDS[2]).read_bytes()
    ranges = [rng for _, m, f, rng in hub_client.requests if m == "GET" and f == SHARDS[2]]
    assert ranges == [None, "bytes=768-"], hub_client.requests  # 3 whole chunks of the 1000 bytes were kept


def test_hub_refusals_exit_2(hub_client, tmp_path):
    data = write_jsonl(tmp_path / "req.jsonl", PROMPTS[:1])
    for ref, named in [("acme/gated", "gated"), ("acme/nothing", "no such model"), (f"{REPO}@v9", "no revision 'v9'")]:
        r = run_local(["--model-name", ref, "--infer-data", data])
        assert r.returncode == 2 and named in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr
