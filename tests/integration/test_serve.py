"""Serve mode (--serve) driven by the `openai` package, at P = 1 and P = 2: the same answers as file
mode, chat, streaming, errors, concurrency, the Batch API (a batch survives SIGKILL of the server)
and SIGTERM shutdown. One server per P is shared by the module's tests (in file order)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.utils import (RUNNER, _env, assert_consistent_results, free_port, read_jsonl, run_single, wait_served,
                         write_jsonl)

try:  # the HTTP client the openai package (a declared test dependency) brings: httpx, or its fork httpx2
    import httpx
except ImportError:
    import httpx2 as httpx

KEY = "sk-test-serve"
NAME = "tiny"

REQUESTS = [
    {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 3},
    {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 1},
    {"prompt": "Hello", "max_tokens": 10, "temperature": 0.8, "n": 2, "seed": 7},
    {"prompt": "A B C", "max_tokens": 12, "temperature": 0, "stop": ["e", "a"]},
    {"prompt": ["one", "two"], "max_tokens": 4, "temperature": 0},
    {"prompt": "Score this sentence", "max_tokens": 0, "echo": True, "logprobs": 0},
]
CHAT = {"messages": [{"role": "user", "content": "Say something"}], "max_tokens": 8, "temperature": 0}


class Server:
    """The runner in serve mode as a process group (torchrun for P > 1)."""

    def __init__(self, model: str, nproc: int, serve_dir: Path, log: Path, extra: tuple[str, ...] = ()):
        self.model, self.nproc, self.serve_dir, self.log, self.extra = model, nproc, serve_dir, log, list(extra)
        self.base, self.proc = None, None

    def start(self) -> None:
        args = [str(RUNNER), "--model-name", self.model, "--serve", "0", "--served-model-name", NAME,
                "--serve-dir", str(self.serve_dir), "--api-key", KEY, "--max-pending", "40",
                "--max-request-bytes", "200000", "--num-threads", "1", "--no-progress", *self.extra]
        if self.nproc > 1:
            args = ["-m", "torch.distributed.run", "--nproc-per-node", str(self.nproc), "--master-addr", "127.0.0.1",
                    "--master-port", str(free_port()), *args]
        since = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, *args], stdout=log, stderr=log, env=_env(None),
                                         start_new_session=True)
        self.base = wait_served(self.proc, self.log, 180, since)  # a port of its own at every start

    def url(self, path: str) -> str:
        return self.base + path

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url("/v1"), api_key=KEY, max_retries=0, timeout=120, **kw)

    def tree(self) -> list[int]:
        """The launcher and every process under it (torchrun starts each rank in a session of its own)."""
        return [self.proc.pid, *descendants(self.proc.pid)] if self.proc is not None else []

    def kill(self, sig=signal.SIGKILL) -> None:
        """SIGKILL: the launcher and every rank at once (a crash); other signals: to the launcher only."""
        if self.proc is None:
            return
        for pid in self.tree() if sig == signal.SIGKILL else [self.proc.pid]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL:
            self.proc.wait()


def descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for k in kids:
            out += [k, *descendants(k)]
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def reference(llama_2l, tmp_path_factory):
    """File mode's answers to REQUESTS and to the batch file (P = 1)."""
    d = tmp_path_factory.mktemp("serve_ref")
    src = write_jsonl(d / "r.jsonl", REQUESTS)
    batch = write_jsonl(d / "b.jsonl", batch_lines(chat=True))
    for path in (src, batch):
        res = run_single(["--model-name", llama_2l, "--infer-data", path, "--num-threads", "1", "--no-progress"], timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
    return read_jsonl(d / "output_r.jsonl"), read_jsonl(d / "output_b.jsonl")


CHAT_LINE = {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}


def batch_lines(extra: int = 0, chat: bool = False) -> list[dict]:
    """Completion lines (a batch holds one endpoint's requests, as OpenAI's; file mode mixes them: ``chat``)."""
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": r} for i, r in enumerate(REQUESTS)]
    if chat:
        lines.append(CHAT_LINE)
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 0}})
    lines += [{"custom_id": f"x{i}", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": f"Line {i} of a long batch", "max_tokens": 40, "temperature": 0.7, "seed": i}}
              for i in range(extra)]
    return lines


@pytest.fixture(scope="module", params=[1, 2], ids=["P1", "P2"])
def server(request, llama_2l, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"serve_P{request.param}")
    s = Server(llama_2l, request.param, d / "state", d / "server.log")
    try:
        s.start()
        yield s
    finally:
        s.kill()


def as_lines(results: list[dict]) -> list[dict]:
    return [{"request": i, "result": r} for i, r in enumerate(results)]


def test_health_models_and_auth(server):
    assert httpx.get(server.url("/health")).json()["status"] == "ok"
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    r = httpx.get(server.url("/v1/models"))
    assert r.status_code == 401 and "error" in r.json()
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url("/v1"), api_key="wrong", max_retries=0).models.list()


def test_completions_match_file_mode(server, reference):
    client = server.client()
    got = [client.completions.create(model=NAME, **r).model_dump(exclude_unset=True) for r in REQUESTS]
    ref = [line["result"] for line in reference[0]]
    for g in got:
        assert g["model"] == NAME and g["object"] == "text_completion"
    keep = ("choices", "usage")
    assert_consistent_results(as_lines([{k: g[k] for k in keep} for g in got]),
                              as_lines([{k: r[k] for k in keep} for r in ref]))
    assert got[2]["choices"][0]["text"] == client.completions.create(model=NAME, **REQUESTS[2]).choices[0].text


def test_chat_and_streaming(server, reference):
    client = server.client()
    chat = client.chat.completions.create(model=NAME, **CHAT)
    ref_chat = next(line for line in reference[1] if line["custom_id"] == "chat")["response"]["body"]
    assert chat.choices[0].message.content == ref_chat["choices"][0]["message"]["content"]
    assert chat.usage.completion_tokens == ref_chat["usage"]["completion_tokens"]
    for req in (REQUESTS[0], REQUESTS[3], {"prompt": "Streaming", "max_tokens": 30, "temperature": 0}):
        full = client.completions.create(model=NAME, **req)
        chunks = list(client.completions.create(model=NAME, stream=True, stream_options={"include_usage": True}, **req))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full.choices[0].text
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
        if req["max_tokens"] == 30:  # text arrives token by token, not only at the end
            assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 10
    stream = client.chat.completions.create(model=NAME, stream=True, **CHAT)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content


def test_streamed_logprobs(server):
    """Each chunk carries the logprobs of the tokens in its delta; joined, they are the non-streamed ones."""
    client = server.client()
    req = {"prompt": "Logprobs stream", "max_tokens": 20, "temperature": 0, "logprobs": 2, "stop": ["zz"]}
    full = client.completions.create(model=NAME, **req).choices[0].logprobs
    chunks = [c.choices[0] for c in client.completions.create(model=NAME, stream=True, **req) if c.choices]
    with_lp = [c for c in chunks if c.logprobs and c.logprobs.tokens]
    assert len(with_lp) > 5  # token by token, not only in the last chunk
    for c in with_lp:
        assert "".join(c.logprobs.tokens) == c.text
    joined = {k: sum((getattr(c.logprobs, k) for c in with_lp), []) for k in ("tokens", "text_offset", "top_logprobs")}
    assert joined["tokens"] == full.tokens and joined["text_offset"] == full.text_offset
    assert [sorted(t) for t in joined["top_logprobs"]] == [sorted(t) for t in full.top_logprobs]
    assert sum((c.logprobs.token_logprobs for c in with_lp), []) == pytest.approx(full.token_logprobs, abs=1e-4)
    chat = {**CHAT, "logprobs": True, "top_logprobs": 2}
    ref = client.chat.completions.create(model=NAME, **chat).choices[0].logprobs.content
    got = [t for c in client.chat.completions.create(model=NAME, stream=True, **chat)
           if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in got] == [t.token for t in ref]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in ref], abs=1e-4)
    assert all(len(t.top_logprobs) == 2 for t in got)


def test_bad_requests(server):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url("/v1/completions"), content=b'{"prompt": "x"', headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"] == "the body is not valid JSON: it ends before the JSON value is complete (column 15)"
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "x", "temperature": 9}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "x", "model": "other"}, headers=h)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "x" * 300000}, headers=h)
    assert r.status_code == 413
    for stream in (False, True):  # found when tokenizing, on the pipeline thread
        r = httpx.post(server.url("/v1/completions"), json={"prompt": [10**9], "stream": stream}, headers=h)
        assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    r = httpx.get(server.url("/v1/batches/batch_nope"), headers=h)
    assert r.status_code == 404
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=NAME, prompt="x", max_tokens=-1)
    assert server.client().completions.create(model=NAME, prompt="still alive", max_tokens=2).choices


def test_concurrent_clients(server):
    client = server.client()
    results, errors = {}, []

    def worker(t: int) -> None:
        try:
            for k in range(2):
                i = 2 * t + k
                r = client.completions.create(model=NAME, prompt=f"Request {i} says", max_tokens=12, seed=i)
                results[i] = r.choices[0].text
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and sorted(results) == list(range(32))
    # seeded requests repeat alone what they answered among 31 others
    assert client.completions.create(model=NAME, prompt="Request 5 says", max_tokens=12, seed=5).choices[0].text == results[5]


def test_too_many_pending(server):
    h = {"Authorization": f"Bearer {KEY}"}
    codes, retry = [], []

    def one() -> None:
        r = httpx.post(server.url("/v1/completions"), json={"prompt": "busy", "max_tokens": 480, "temperature": 0},
                       headers=h, timeout=120)
        codes.append(r.status_code)
        if r.status_code == 429:
            retry.append(r.headers.get("retry-after"))

    threads = [threading.Thread(target=one) for _ in range(70)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
    assert retry[0] == "1"


def test_client_disconnect_frees_rows(server):
    h = {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), json={"prompt": "leave", "max_tokens": 480, "n": 16},
                   headers=h, timeout=0.3)
    deadline = time.monotonic() + 20
    while "the client left; its rows are freed" not in server.log.read_text():
        assert time.monotonic() < deadline, "the disconnect was not noticed"
        time.sleep(0.1)
    while httpx.get(server.url("/health")).json()["pending"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # the server lives on and answers
    assert server.client().completions.create(model=NAME, prompt="after", max_tokens=3).choices


def wait_batch(client, bid: str, until=("completed", "failed", "cancelled", "expired"), timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(bid)
        if b.status in until:
            return b
        time.sleep(0.2)
    raise AssertionError(f"batch {bid} still {b.status}")


def batch_bodies(text: str) -> dict[str, dict]:
    out = {}
    for line in text.splitlines():
        if line.strip():
            obj = json.loads(line)
            assert obj["custom_id"] not in out, "a custom_id answered twice"
            out[obj["custom_id"]] = obj
    return out


def test_batch_api(server, reference, tmp_path):
    client = server.client()
    f = client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in batch_lines()).encode()),
                            purpose="batch")
    assert f.id.startswith("file-") and client.files.retrieve(f.id).bytes == f.bytes
    assert not (server.serve_dir / "files" / "in.jsonl").exists()
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert batch.request_counts.total == len(batch_lines())
    done = wait_batch(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == len(batch_lines()) - 1
    assert done.request_counts.failed == 1
    out = batch_bodies(client.files.content(done.output_file_id).text)
    errs = batch_bodies(client.files.content(done.error_file_id).text)
    assert set(errs) == {"bad"} and set(out) == {x["custom_id"] for x in batch_lines()} - {"bad"}
    ref = {x["custom_id"]: x for x in reference[1]}
    ids = sorted(out)
    assert_consistent_results(as_lines([{"choices": out[i]["response"]["body"]["choices"]} for i in ids]),
                              as_lines([{"choices": ref[i]["response"]["body"]["choices"]} for i in ids]))
    assert batch.id in [b.id for b in client.batches.list()]
    listed = [x.id for x in client.files.list(purpose="batch")]
    assert f.id in listed and done.output_file_id not in listed
    assert done.output_file_id in [x.id for x in client.files.list()]
    assert client.files.delete(f.id).deleted
    assert f.id not in [x.id for x in client.files.list()]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    chat = client.files.create(file=("chat.jsonl", (json.dumps(CHAT_LINE) + "\n").encode()), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="differs from the batch's endpoint"):
        client.batches.create(input_file_id=chat.id, endpoint="/v1/completions", completion_window="24h")
    done = wait_batch(client, client.batches.create(input_file_id=chat.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h").id)
    got = batch_bodies(client.files.content(done.output_file_id).text)["chat"]["response"]["body"]["choices"]
    assert_consistent_results(as_lines([{"choices": got}]),
                              as_lines([{"choices": ref["chat"]["response"]["body"]["choices"]}]))


def test_batch_cancel(server):
    client = server.client()
    lines = batch_lines(extra=200)
    f = client.files.create(file=("c.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError) as e:  # a restart would resume from it
        client.files.delete(f.id)
    assert "has not finished" in e.value.response.json()["error"]["message"]  # the server's words, not openai's
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled", "completed")
    done = wait_batch(client, batch.id)
    assert done.status in ("cancelled", "completed")
    if done.status == "cancelled":
        out = batch_bodies(client.files.content(done.output_file_id).text)
        assert len(out) < len(lines) and done.request_counts.completed == len(out)


def test_batch_survives_sigkill(server):
    client = server.client()
    lines = batch_lines(extra=60)
    f = client.files.create(file=("big.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (counts := client.batches.retrieve(batch.id).request_counts).completed < 10:  # they advance as it runs
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server.kill(signal.SIGKILL)
    assert counts.completed < len(lines)
    server.start()
    client = server.client()
    done = wait_batch(client, batch.id)
    assert done.status == "completed", done
    out = batch_bodies(client.files.content(done.output_file_id).text)
    errs = batch_bodies(client.files.content(done.error_file_id).text)
    assert sorted([*out, *errs]) == sorted(x["custom_id"] for x in lines) and set(errs) == {"bad"}


def test_restart_with_another_seed_delivers_the_answered_lines(llama_2l, tmp_path):
    """A server killed mid-batch and started again with another --seed: the batch fails with the lines
    it answered in its output file and the others listed in its error file; no server path shown."""
    s = Server(llama_2l, 1, tmp_path / "state", tmp_path / "server.log")
    try:
        s.start()
        client = s.client()
        lines = batch_lines(extra=60)
        f = client.files.create(file=("big.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while client.batches.retrieve(batch.id).request_counts.completed < 5:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        s.kill(signal.SIGKILL)
        s.extra = ["--seed", "7"]
        s.start()
        client = s.client()
        done = wait_batch(client, batch.id)
        assert done.status == "failed", done
        message = done.errors.data[0].message
        assert "other settings" in message and str(tmp_path) not in message and "/" not in message
        out = batch_bodies(client.files.content(done.output_file_id).text)
        errs = batch_bodies(client.files.content(done.error_file_id).text)
        assert out and sorted([*out, *errs]) == sorted(x["custom_id"] for x in lines)
        assert errs[lines[-1]["custom_id"]]["error"]["code"] == "batch_failed"
        assert done.request_counts.completed == len(out) and done.request_counts.failed == len(errs)
    finally:
        s.kill()


def test_sigterm_stops_every_rank(server):
    client = server.client()
    answers = []
    t = threading.Thread(target=lambda: answers.append(
        client.completions.create(model=NAME, prompt="in flight", max_tokens=60, temperature=0)))
    t.start()
    time.sleep(0.3)
    procs = server.tree()
    assert len(procs) >= server.nproc
    t0 = time.monotonic()
    server.kill(signal.SIGTERM)
    server.proc.wait(timeout=30)
    t.join(30)
    deadline = t0 + 30
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in procs), "a rank outlived SIGTERM by 30 s"
    assert time.monotonic() - t0 < 20, "SIGTERM should stop the server well within 30 s"
    assert answers and answers[0].choices[0].finish_reason == "length"  # the in-flight request was finished


def test_scheduler_priority_and_spare_rows():
    """Pure scheduler logic: interactive groups go ahead of queued batch lines (in their own arrival
    order), and serve mode sizes a new micro-batch with free rows for requests still to come."""
    from pipeline.scheduling.scheduler import Group, Scheduler, SchedulerConfig, ServePolicy

    s = Scheduler(SchedulerConfig(budget=4096, num_slots=1, max_rows=8), policy=ServePolicy())
    for gid in range(3):
        s.submit(Group(gid, 10, 10))
    s.submit(Group(10, 10, 10, priority=True))
    s.submit(Group(11, 10, 10, priority=True))
    assert [g.gid for g in s.queue] == [10, 11, 0, 1, 2]
    s.shed()
    s.submit(Group(20, 10, 10, priority=True))
    ps = s.next_pass(0)
    assert ps.alloc == (8, 512)  # one request, but 8 rows of 4096 / 8 columns
    s.on_reply(0, [ps.prefill[0][1]], [])
    s.submit(Group(21, 100, 50, priority=True))
    ps = s.next_pass(0)
    assert ps.alloc is None and [gid for gid, _ in ps.prefill] == [21]  # joined the running micro-batch


def test_serve_flags():
    from pipeline.config.options import parse_options, serve_address
    from serve.server import _loopback

    assert serve_address("8000") == ("127.0.0.1", 8000)
    assert serve_address("0.0.0.0:9000") == ("0.0.0.0", 9000)
    assert serve_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="HOST:]PORT"):
        serve_address("localhost")
    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost") and not _loopback("0.0.0.0")
    with pytest.raises(SystemExit):
        parse_options(["--serve", "8000", "--infer-data", "x.jsonl"])
    with pytest.raises(SystemExit):
        parse_options(["--serve", "8000", "--data-group-size", "2"])
    assert parse_options(["--serve", "8000"]).max_pending == 256


def test_dropped_request_releases_its_prefix_digests():
    """A queued request whose client left takes its pending prefix-cache digests with it (they would
    otherwise keep blocks pinned against eviction and count as sharing evidence forever)."""
    import asyncio

    from pipeline.scheduling.driver import Driver
    from pipeline.cache.prefix import PrefixCache
    from pipeline.scheduling.scheduler import Scheduler, SchedulerConfig, ServePolicy
    from serve.engine import ServeRank
    from serve.http_channel import Live, RequestSource
    from tasks.requests import parse_body

    prefix = PrefixCache(4, 4096)
    driver = Driver(None, 100, 512, Scheduler(SchedulerConfig(4096, 1, 8), prefix=prefix, policy=ServePolicy()))
    source = RequestSource(10)
    rank = ServeRank(None, driver, None, object(), source, None)
    loop = asyncio.new_event_loop()
    try:
        lives = [Live(parse_body({"prompt": list(range(1, 20)), "max_tokens": 4, "n": n}, False), loop,
                      loop.create_future()) for n in (1, 2)]
        for live in lives:
            source.submit(live)
        rank._take(source.take())
        assert len(driver.sched.queue) == 2 and prefix.pending[block_key(prefix)] == 2
        rank._cancel(lives[0])
        assert len(driver.sched.queue) == 1 and prefix.pending[block_key(prefix)] == 1
        rank._cancel(lives[1])
        assert not driver.sched.queue and not prefix.pending and not driver.metas
        assert source.pending == 0
    finally:
        loop.close()


def block_key(prefix) -> bytes:
    from pipeline.cache.prefix import block_digests

    return block_digests(list(range(1, 20)), prefix.block_size)[0]


def test_non_loopback_without_key_warns(caplog, monkeypatch, tmp_path):
    """Binding beyond loopback without a key prints a warning before anything loads; a key (flag or
    environment) silences it."""
    from types import SimpleNamespace

    from serve import run

    class Loaded(Exception):
        pass

    def first_rank(*_):
        raise Loaded

    monkeypatch.delenv(run.API_KEY_ENV, raising=False)
    for serve, key, env, warned in (("0.0.0.0:1", None, None, True), ("127.0.0.1:1", None, None, False),
                                    ("0.0.0.0:1", "k", None, False), ("0.0.0.0:1", None, "k", False)):
        if env:
            monkeypatch.setenv(run.API_KEY_ENV, env)
        caplog.clear()
        with caplog.at_level("WARNING", logger="serve"), pytest.raises(Loaded):
            opts = SimpleNamespace(serve=serve, api_key=key, serve_dir=str(tmp_path))
            run.run_server(None, opts, None, None, first_rank)
        assert ("without an API key" in caplog.text) == warned, (serve, key, env)


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
    """A server sends for as long as it runs: rank 0 keeps a bounded number of unfinished sends (each
    holds its tensor) instead of every send since it started."""
    env = dict(_env(None), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [subprocess.Popen([sys.executable, "-c", SENDS, str(r)], env=env, stderr=subprocess.PIPE) for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
