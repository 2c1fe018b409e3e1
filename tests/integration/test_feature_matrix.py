"""The feature matrix's runs over HTTP (tests/runs/test_feature_matrix_runs.py: the pairwise matrix, its
references and checks; file mode's runs, in one process): each ``serve`` run of the matrix starts a
server with the run's options and sends the requests one after the other."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.runs.test_feature_matrix_runs import SERVE_RUNS, check_run, flags, reference, requests, setup  # noqa: F401
from tests.utils import RUNNER, _env, _kill_group, free_port, wait_served


@pytest.mark.parametrize("run", SERVE_RUNS, ids=lambda r: ",".join(f"{k}={int(v)}" for k, v in r.items()))
def test_pairwise_serve_runs_give_their_references_answers_and_show_each_feature(setup, run, tmp_path):  # noqa: F811
    check_run(serve_run(run, setup, tmp_path), run, reference(run, setup), None)


def serve_run(run: dict, setup: dict, tmp_path: Path) -> list[dict]:
    """The requests one after the other over HTTP to a server of the run's options; result lines."""
    args = [str(RUNNER), *flags(run, setup), "--serve", "0", "--serve-dir", str(tmp_path / "state")]
    if run["stages"] > 1:
        args = ["-m", "torch.distributed.run", "--nproc-per-node", str(run["stages"]), "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), *args]
    log = tmp_path / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, *args], stdout=f, stderr=f, env=_env(None), start_new_session=True)
    try:
        url = wait_served(proc, log, 300)
        return [{"request": r, "result": _post(f"{url}/v1/completions", r)}
                for r in requests(run["lora"])]
    finally:
        _kill_group(proc)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())
