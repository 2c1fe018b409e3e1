"""Hub ids resolved from a cache laid out as huggingface_hub lays it out, with no network: by id, by
revision and by commit, online (a hub that cannot be reached) and with HF_HUB_OFFLINE=1; a missing model,
a missing shard and an uncached revision each refused with a message naming it (exit 2 from the runner)."""

from __future__ import annotations

import contextlib
import io

import pytest
from huggingface_hub import constants

import dist_inference_runner
from pipeline.config.options import UsageError
from pipeline.loading.hub import (ModelUnavailable, looks_like_repo_id, missing_tokenizer, missing_weights,
                                  resolve_model, split_ref, weight_files)
from tests.hub_helpers import COMMIT, OLD_COMMIT, build_cache, sharded_llama
from tests.utils import free_port

REPO = "acme/tiny-llama"
SHARDS = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return sharded_llama(tmp_path_factory.mktemp("hub-model") / "tiny")


@pytest.fixture(scope="module")
def cache(model, tmp_path_factory):
    """main -> COMMIT (complete); tag v1 -> OLD_COMMIT (complete); acme/partial lacks its middle shard."""
    root = tmp_path_factory.mktemp("hub-cache")
    build_cache(root, REPO, model, COMMIT, refs=("main",))
    build_cache(root, REPO, model, OLD_COMMIT, refs=("v1",))
    build_cache(root, "acme/partial", model, COMMIT, skip=(SHARDS[1],))
    return root


@pytest.fixture(params=["online", "offline"])
def mode(request, monkeypatch):
    """online: a hub that refuses connections (a closed port on 127.0.0.1); offline: HF_HUB_OFFLINE=1."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", request.param == "offline")
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the hub cannot be reached
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    return request.param


@pytest.mark.parametrize("ref,revision,commit", [
    (REPO, None, COMMIT), (REPO, "main", COMMIT), (REPO, "v1", OLD_COMMIT), (f"{REPO}@v1", None, OLD_COMMIT),
    (REPO, OLD_COMMIT, OLD_COMMIT), (f"{REPO}@{COMMIT}", None, COMMIT)])
def test_found_in_cache_by_id_revision_and_commit(cache, mode, ref, revision, commit):
    source = resolve_model(ref, revision, str(cache))
    assert source.repo_id == REPO and source.commit == commit
    assert source.folder == cache / "models--acme--tiny-llama" / "snapshots" / commit
    assert source.name == f"{REPO}@{commit}" and source.record == f"hub:{REPO}@{commit}"
    assert weight_files(source) == SHARDS
    missing_weights(source)  # every shard cached: nothing to refuse


def test_missing_model_names_it(cache, monkeypatch):
    # (online with an unreachable hub the library retries for ~25 s before the same answer; the local hub
    # server of tests/integration/test_hub_download.py answers a missing model at once)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelUnavailable, match="acme/nothing-here.*hf download acme/nothing-here"):
        resolve_model("acme/nothing-here", None, str(cache))


def test_uncached_revision_names_it(cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelUnavailable, match=r"acme/tiny-llama \(revision v2\).*--revision v2"):
        resolve_model(REPO, "v2", str(cache))


def test_missing_shard_names_it(cache, mode):
    source = resolve_model("acme/partial", None, str(cache))
    with pytest.raises(ModelUnavailable, match=f"{SHARDS[1]}.*hf download acme/partial {SHARDS[1]}"):
        missing_weights(source)
    missing_weights(source, depth=1)  # a run over layer 0 only needs shards 1 and 3 (non-layer tensors)
    if mode == "offline":
        with pytest.raises(ModelUnavailable, match="unset HF_HUB_OFFLINE"):
            missing_weights(source)


def test_listing_a_hub_that_never_answers_is_bounded(monkeypatch):
    """A hub that accepts connections and never answers: the listing gives up after the library's metadata
    timeout (HF_HUB_ETAG_TIMEOUT) and the run goes on from the cache, instead of waiting forever."""
    import socket
    import threading

    from pipeline.loading.hub import _listing

    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nobody ever answers
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
        found = []
        asking = threading.Thread(target=lambda: found.append(_listing(REPO, COMMIT)), daemon=True)
        asking.start()
        asking.join(30)
        assert found == [None], "the listing still waits on a hub that never answers"


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_token_says_how_to_fix_it(model, monkeypatch, tmp_path, status):
    """The hub's 401 (a token it does not accept) or 403 (a token not allowed to read the repository): one line
    naming the refusal and HF_TOKEN, not the library's multi-line HTTP error nor "the hub cannot be reached"."""
    from tests.hub_helpers import HubServer

    with HubServer({REPO: {"commits": {COMMIT: model}, "refs": {"main": COMMIT}, "refused": status}}) as hub:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint())
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            hub.endpoint() + "/{repo_id}/resolve/{revision}/{filename}")
        with pytest.raises(ModelUnavailable, match=fr"refused access \(HTTP {status}: Invalid credentials.*HF_TOKEN") as e:
            resolve_model(REPO, None, str(tmp_path / "cache"))
    assert "\n" not in str(e.value)


def test_a_folder_missing_a_shard_is_refused_before_loading(model, tmp_path):
    """A local folder whose shard index lists a file it lacks: named from the plan (exit 2), as for a hub id,
    not found by the stage that opens it (at P = 2 another rank's traceback, exit 1)."""
    import shutil

    folder = tmp_path / "partial"
    shutil.copytree(model, folder)
    (folder / SHARDS[1]).unlink()
    source = resolve_model(str(folder))
    missing_weights(source, depth=1)  # layer 0 and the rest: shards 1 and 3
    with pytest.raises(ModelUnavailable, match=f"{SHARDS[1]}, listed in the shard index, are not in the folder"):
        missing_weights(source)
    code, err = run_main(["--model-name", str(folder), "--pipeline-group-size", "2", "--in-process",
                          "--infer-data", str(_requests(tmp_path))])
    assert code == 2 and SHARDS[1] in err and "Traceback" not in err, err


def test_a_model_without_tokenizer_files_is_refused_before_loading(model, monkeypatch, tmp_path):
    """Every run loads a tokenizer from the model's folder: a folder, a cached snapshot (offline) or a
    repository (online) without one is named from the plan (exit 2), not after every stage has loaded
    (and, online, downloaded) its weights, with transformers' five-line message."""
    import shutil

    from tests.hub_helpers import HubServer

    folder = tmp_path / "untokenized"
    shutil.copytree(model, folder, ignore=shutil.ignore_patterns("tokenizer*"))
    code, err = run_main(["--model-name", str(folder), "--pipeline-group-size", "2", "--in-process",
                          "--infer-data", str(_requests(tmp_path))])
    assert code == 2 and "holds no tokenizer files" in err and "copy the tokenizer's files into it" in err, err
    build_cache(tmp_path / "cache", REPO, folder)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelUnavailable, match="holds no tokenizer files.*offline.*hf download"):
        missing_tokenizer(resolve_model(REPO, None, str(tmp_path / "cache")))
    with HubServer({REPO: {"commits": {COMMIT: folder}, "refs": {"main": COMMIT}}}) as hub:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint())
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            hub.endpoint() + "/{repo_id}/resolve/{revision}/{filename}")
        with pytest.raises(ModelUnavailable, match="holds no tokenizer files.*the repository has none"):
            missing_tokenizer(resolve_model(REPO, None, str(tmp_path / "cache")))
        assert not any(f.endswith(".safetensors") for f in hub.gets())


def test_folder_wins_and_refs_parse(model):
    assert resolve_model(str(model)).repo_id is None
    assert looks_like_repo_id("org/name") and looks_like_repo_id("org/name@v1.0")
    assert not looks_like_repo_id("./org/name") and not looks_like_repo_id("/abs/path") and not looks_like_repo_id("a/b/c")
    assert split_ref("org/name@dev", None) == ("org/name", "dev") and split_ref("org/name", None) == ("org/name", "main")
    with pytest.raises(ModelUnavailable, match="give the revision once"):
        split_ref("org/name@dev", "main")


def run_main(args: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = dist_inference_runner.main(args, signals=False)
    return code, err.getvalue()


@pytest.mark.parametrize("args,named", [
    (["--model-name", "acme/nothing-here"], "acme/nothing-here"),
    (["--model-name", "acme/partial"], SHARDS[1]),
    (["--model-name", REPO, "--revision", "v2"], "revision v2"),
])
def test_runner_exits_2_naming_what_is_missing(cache, monkeypatch, tmp_path, args, named):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    code, err = run_main([*args, "--cache-dir", str(cache), "--infer-data", str(_requests(tmp_path))])
    assert code == 2 and named in err and "hf download" in err, err


def test_runner_plans_a_cached_id_offline(cache, monkeypatch, tmp_path):
    from pipeline.config.options import parse_options
    from pipeline.config.plan import make_plan

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    opts = parse_options(["--model-name", f"{REPO}@v1", "--cache-dir", str(cache), "--infer-data",
                          str(_requests(tmp_path))])
    plan = make_plan(opts, env={})
    assert plan.model_name == f"{REPO}@{OLD_COMMIT}" and plan.fingerprint["model"] == f"hub:{REPO}@{OLD_COMMIT}"
    assert plan.served_name == REPO


def _requests(tmp_path):
    path = tmp_path / "req.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 2}\n')
    return path


def test_lora_adapter_by_id_from_the_cache(cache, model, monkeypatch, tmp_path):
    """--lora NAME=org/adapter resolves as the model does (offline: the cache); the run record keeps its commit."""
    from pipeline.config.options import parse_options
    from pipeline.config.plan import make_plan
    from tests.unit.pipeline.models.test_lora import make_adapter

    make_adapter(str(model), tmp_path / "sup", ["q_proj", "v_proj"], seed=3)
    build_cache(cache, "acme/sup-lora", tmp_path / "sup", OLD_COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    opts = parse_options(["--model-name", REPO, "--lora", "sup=acme/sup-lora@main", "--cache-dir", str(cache),
                          "--infer-data", str(_requests(tmp_path))])
    plan = make_plan(opts, env={})
    assert plan.adapters[0].path == cache / "models--acme--sup-lora" / "snapshots" / OLD_COMMIT
    assert plan.fingerprint["lora"] == {"sup": f"hub:acme/sup-lora@{OLD_COMMIT}"}
    opts.lora = ["sup=acme/no-such-lora"]
    with pytest.raises(UsageError, match="--lora acme/no-such-lora.*hf download"):
        make_plan(opts, env={})
