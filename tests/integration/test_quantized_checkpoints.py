"""Serve mode on a pre-quantized checkpoint (a server process). File mode's runs on pre-quantized
checkpoints, in one process: tests/runs/test_precision_runs.py."""

from __future__ import annotations

import subprocess
import sys

from tests import quant_checkpoints as qk
from tests.runs.test_precision_runs import assert_same_tokens as _same
from tests.runs.test_precision_runs import quant_requests as _requests
from tests.runs.test_precision_runs import run_file as _run
from tests.unit.pipeline.models.test_lora import _http
from tests.utils import RUNNER, _env, read_jsonl, wait_served


def test_serve_mode_answers_from_a_gptq_checkpoint_as_file_mode_does(make_llama, tmp_path):
    """The server on a GPTQ int4 checkpoint answers /v1/completions with file mode's tokens and logprobs
    on the same checkpoint (and names the format in ``model``)."""
    base = make_llama(num_hidden_layers=2, seed=5)
    q, _ = qk.gptq(base, tmp_path / "q", tmp_path / "ref", bits=4, group=32)
    data = _requests(tmp_path)
    want = _run(q, data, tmp_path / "q.jsonl", 1)
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(RUNNER), "--model-name", q, "--serve", "0",
                                 "--num-threads", "1", "--serve-dir", str(tmp_path / "s")], stdout=out, stderr=out,
                                env=_env(None), start_new_session=True)
    try:
        url = wait_served(proc, log, 300)
        got = []
        for line in read_jsonl(data):
            status, r = _http(url + "/v1/completions", line)
            assert status == 200, r
            assert "gptq-int4" in r["model"], r["model"]
            got.append({"result": r})
        _same(got, want)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
