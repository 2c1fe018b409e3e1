"""LoRA adapters (--lora) in serve mode (a server process). File mode's runs, in one process:
tests/runs/test_lora_runs.py; the stage math against peft: tests/unit/pipeline/models/test_lora.py."""

from __future__ import annotations

import subprocess
import sys
from tests.utils import RUNNER, _env, hf_greedy, local_tokenizer, wait_served
from tests.unit.pipeline.models.test_lora import _http, llama  # noqa: F401 (a fixture)


def test_serve_lists_and_runs_adapters(llama, tmp_path):
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, str(RUNNER), "--model-name", llama["model"], "--serve", "0",
                             "--served-model-name", "base", "--lora", f"a1={llama['a1']}", "--num-threads", "1",
                             "--serve-dir", str(tmp_path / "s")], stdout=log, stderr=log, env=_env(None),
                            start_new_session=True)
    try:
        url = wait_served(proc, tmp_path / "server.log", 300)
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
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
