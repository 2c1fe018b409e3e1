"""What only a server in processes of its own shows, one test per behaviour: SIGTERM stops every rank of a
P = 2 server after finishing the request in flight (exit 143); a batch survives SIGKILL of the whole
server and resumes when it is started again; an open-file limit below the sockets clients hold; rank 0's
unfinished gloo sends stay bounded over a long run. Everything a server answers over HTTP is tested on
in-process servers (tests/runs/test_serve_*.py, test_batch_api.py)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.serve_cases import batch_bodies, batch_lines, jsonl_bytes, wait_batch, wait_completed
from tests.servers import KEY, ProcessServer, httpx
from tests.utils import _env, free_port

def test_sigterm_stops_every_rank(llama_2l, tmp_path):
    """P = 2, one process a rank: SIGTERM to every rank (a scheduler stopping the job) finishes the request in
    flight, then every rank exits with 143 (the signal's code, as file mode's) well within 30 s."""
    server = ProcessServer(["--model-name", llama_2l], 2, tmp_path).start()
    try:
        client = server.client()
        answers = []
        t = threading.Thread(target=lambda: answers.append(
            client.completions.create(model=Path(llama_2l).name, prompt="in flight", max_tokens=60, temperature=0)))
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        for p in server.procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=30) for p in server.procs]
        t.join(30)
        assert time.monotonic() - t0 < 20, "SIGTERM should stop the server well within 30 s"
        log = server.log.read_text()
        assert codes == [128 + signal.SIGTERM] * 2, (codes, log[-3000:])
        assert answers and answers[0].choices[0].finish_reason == "length"  # the in-flight request was finished
        assert "SIGTERM received, finishing in-flight requests and stopping" in log, log[-3000:]
        with pytest.raises(httpx.HTTPError):  # its port closed with it
            httpx.get(server.url("/health"), timeout=5)
    finally:
        server.kill()


def test_batch_survives_sigkill(llama_2l, tmp_path):
    """The server SIGKILLed mid-batch and started again on its --serve-dir: the batch resumes from its journal
    and ends with every line answered exactly once (a graceful stop and restart: tests/runs/test_batch_api.py)."""
    server = ProcessServer(["--model-name", llama_2l], 1, tmp_path).start()
    try:
        client = server.client()
        lines = batch_lines(extra=60)
        f = client.files.create(file=("big.jsonl", jsonl_bytes(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        assert wait_completed(client, batch.id, 10) < len(lines)
        server.kill()
        client = server.start().client()
        done = wait_batch(client, batch.id)
        assert done.status == "completed", done
        out = batch_bodies(client.files.content(done.output_file_id).text)
        errs = batch_bodies(client.files.content(done.error_file_id).text)
        assert sorted([*out, *errs]) == sorted(x["custom_id"] for x in lines) and set(errs) == {"bad"}
    finally:
        server.kill()


def test_open_file_limit(tmp_path):
    """300 half-sent requests against the server's open-file limit of 256: /health and completions still answer
    (the connection cap closes idle connections first)."""
    server = ProcessServer(["--header-timeout", "3", "--body-timeout", "3", "--send-timeout", "4"], 1, tmp_path,
                           nofile=256).start()
    socks, port = [], int(server.base.rpartition(":")[2])
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            socks.append(s)
        for _ in range(3):
            try:
                r = httpx.get(server.url("/health"), timeout=5)
                break
            except httpx.HTTPError:
                continue
        assert r.status_code == 200
        r = httpx.post(server.url("/v1/completions"), json={"prompt": "Hello", "max_tokens": 8, "temperature": 0},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        for s in socks:
            s.close()
        server.kill()


SENDS = """
import datetime, os, sys, torch, torch.distributed as dist
from comm.p2p import _WINDOW, Messenger, open_channels
rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)
channels = open_channels(rank, 2, 1, "gloo", datetime.timedelta(seconds=60))
m = Messenger(rank, torch.device("cpu"), channels)
for i in range(300):
    if rank == 0:
        m.send(1, b"header %d" % i, torch.full((4, 8), float(i)))
    else:
        header, x = m.recv(0)
        assert header == b"header %d" % i and x[0, 0].item() == i
if rank == 0:
    assert len(m._pending) <= _WINDOW + 3, len(m._pending)  # gloo sends never report completion before wait()
    m.flush()
dist.destroy_process_group()
"""


def test_sends_do_not_accumulate():
    """A server sends for as long as it runs: rank 0 keeps a bounded number of unfinished gloo sends (each
    holds its tensor) instead of every send since it started."""
    env = dict(_env(None), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, "-c", SENDS, str(r)], env=env, stderr=subprocess.PIPE) for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
