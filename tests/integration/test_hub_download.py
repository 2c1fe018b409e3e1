"""Hub ids against a local hub on 127.0.0.1 (tests/hub_helpers.HubServer, HF_ENDPOINT pointed at it):
at P = 2 each rank asks only for its own shards, an interrupted download resumes with a Range request,
two ranks sharing a node's cache fetch each file once, and the results equal those of the same model
given as a folder; a rerun on another revision is not taken for finished work. Serve mode on a hub id:
tests/runs/test_serve_models_runs.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.hub_helpers import COMMIT, OLD_COMMIT, HubServer, sharded_llama
from tests.utils import REPO as ROOT
from tests.utils import RUNNER, _env, _kill_group, free_port, read_jsonl, run_single, run_torchrun, strip_volatile, write_jsonl

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
    r = run_torchrun(["--model-name", str(model), "--lora", f"sup={adapter}", "--infer-data", data, "--budget", "256"],
                     2, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return results(work / "output_req.jsonl")


def test_two_ranks_on_one_node_fetch_each_file_once(hub, folder_results, tmp_path):
    data = write_jsonl(tmp_path / "req.jsonl", PROMPTS)
    env = {"HF_ENDPOINT": hub.endpoint(), "HF_HUB_CACHE": str(tmp_path / "cache")}
    r = run_torchrun(["--model-name", REPO, "--lora", "sup=acme/sup-lora", "--infer-data", data, "--budget", "256"], 2,
                     timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    gets = hub.gets()
    assert sorted(gets) == sorted(set(gets)), f"a file was downloaded twice: {gets}"
    assert set(SHARDS) | {"adapter_model.safetensors"} <= set(gets)
    lines = read_jsonl(tmp_path / "output_req.jsonl")
    assert [line["result"]["model"] for line in lines] == [f"{REPO}@{COMMIT}"] * 3 + ["sup"]
    assert results(tmp_path / "output_req.jsonl") == folder_results
    # another revision is another run: its output is not taken for finished work
    r = run_single(["--model-name", f"{REPO}@v1", "--lora", "sup=acme/sup-lora", "--infer-data", data], timeout=300,
                   env=env)
    assert r.returncode == 2 and "written by another run" in r.stderr and OLD_COMMIT in r.stderr, r.stderr[-2000:]


def test_each_rank_fetches_only_its_own_shards(hub, folder_results, tmp_path):
    """Two "nodes" (a cache each, told apart by their endpoint prefix): stage 0 (layers 0-1) asks for
    shards 1-2, stage 1 (layers 2-3) for shards 2-3."""
    data = write_jsonl(tmp_path / "req.jsonl", PROMPTS)
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    try:
        for rank in (0, 1):
            env = _env({"HF_ENDPOINT": hub.endpoint(f"r{rank}"), "HF_HUB_CACHE": str(tmp_path / f"node{rank}")})
            procs.append(subprocess.Popen(
                [sys.executable, str(RUNNER), "--model-name", REPO, "--lora", "sup=acme/sup-lora", "--infer-data", data,
                 "--budget", "256",
                 "--rank", str(rank), "--world-size", "2", "--pipeline-group-size", "2", "--dist-url", url],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True))
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            _kill_group(p)
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert hub.touched("r0") & set(SHARDS) == {SHARDS[0], SHARDS[1]}
    assert hub.touched("r1") & set(SHARDS) == {SHARDS[1], SHARDS[2]}
    assert results(tmp_path / "output_req.jsonl") == folder_results


# the library writes what it received in chunks of DOWNLOAD_CHUNK_SIZE (10 MiB) and resumes from the last
# whole chunk: small chunks make a resume visible on a tiny shard
FETCH = """
import sys
from huggingface_hub import constants
constants.DOWNLOAD_CHUNK_SIZE = 256
from pipeline.loading.hub import missing_weights, resolve_model
source = resolve_model(sys.argv[1])
missing_weights(source)
assert source.fetch(sys.argv[2])
print(source.folder / sys.argv[2])
"""


def test_interrupted_download_resumes(hub, model, tmp_path):
    hub.cut[SHARDS[2]] = 1000  # the first GET ends after 1000 bytes, the connection closed
    env = _env({"HF_ENDPOINT": hub.endpoint(), "HF_HUB_CACHE": str(tmp_path / "cache")})
    r = subprocess.run([sys.executable, "-c", FETCH, REPO, SHARDS[2]], capture_output=True, text=True, env=env,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert Path(r.stdout.strip()).read_bytes() == (model / SHARDS[2]).read_bytes()
    ranges = [rng for _, m, f, rng in hub.requests if m == "GET" and f == SHARDS[2]]
    assert ranges == [None, "bytes=768-"], hub.requests  # 3 whole chunks of the 1000 bytes were kept


@pytest.mark.parametrize("ref,named", [("acme/gated", "gated"), ("acme/nothing", "no such model"),
                                       (f"{REPO}@v9", "no revision 'v9'")])
def test_hub_refusals_exit_2(hub, tmp_path, ref, named):
    data = write_jsonl(tmp_path / "req.jsonl", PROMPTS[:1])
    env = _env({"HF_ENDPOINT": hub.endpoint(), "HF_HUB_CACHE": str(tmp_path / "cache")})
    r = subprocess.run([sys.executable, str(RUNNER), "--model-name", ref, "--infer-data", data],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and named in r.stderr, r.stderr[-2000:]
