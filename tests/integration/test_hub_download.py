"""Hub ids against a local hub on 127.0.0.1 (tests/hub_helpers.HubServer, HF_ENDPOINT pointed at it), as
only processes show it: the ranks of a node, two processes, share its cache (each file fetched once)
and each asks only for its own shards. The rest, in one process: tests/runs/test_hub_runs.py; serve mode
on a hub id: tests/runs/test_serve_models_runs.py."""

from __future__ import annotations

import subprocess
import sys

from tests.runs.test_hub_runs import (COMMIT, PROMPTS, REPO, SHARDS, adapter, folder_results, hub, model,  # noqa: F401
                                      results)
from tests.utils import RUNNER, _env, _kill_group, free_port, read_jsonl, write_jsonl


def test_ranks_of_a_node_share_its_cache_and_each_fetches_only_its_own_shards(hub, folder_results,  # noqa: F811
                                                                             tmp_path):
    """Two ranks (the seed's per-rank launch, each with its own endpoint prefix so that the hub tells them
    apart) and one HF_HUB_CACHE: no file is downloaded twice (the cache's locks hold across processes),
    stage 0 (layers 0-1) asks only for shards 1-2 and stage 1 (layers 2-3) only for shards 2-3, and the
    results equal the folders' (the adapter by id too)."""
    data = write_jsonl(tmp_path / "req.jsonl", PROMPTS)
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    try:
        for rank in (0, 1):
            env = _env({"HF_ENDPOINT": hub.endpoint(f"r{rank}"), "HF_HUB_CACHE": str(tmp_path / "cache")})
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
    gets = hub.gets()
    assert sorted(gets) == sorted(set(gets)), f"a file was downloaded twice: {gets}"
    assert set(SHARDS) | {"adapter_model.safetensors"} <= set(gets)
    assert hub.touched("r0") & set(SHARDS) <= {SHARDS[0], SHARDS[1]} and SHARDS[0] in hub.touched("r0")
    assert hub.touched("r1") & set(SHARDS) <= {SHARDS[1], SHARDS[2]} and SHARDS[2] in hub.touched("r1")
    lines = read_jsonl(tmp_path / "output_req.jsonl")
    assert [line["result"]["model"] for line in lines] == [f"{REPO}@{COMMIT}"] * 3 + ["sup"]
    assert results(tmp_path / "output_req.jsonl") == folder_results
