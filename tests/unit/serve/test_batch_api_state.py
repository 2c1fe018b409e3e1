"""The Batch API's state, in process (FastAPI's TestClient against the app, no model, no server):
per-key isolation, quotas and expiry, OpenAI's create-time validations, partial results of batches
that end early, a --serve-dir trusted only when safe, records read back from disk validated, and
the engine's batch decisions (a restart under other settings, expiry, a full disk)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import orjson
from fastapi.testclient import TestClient

from tasks import batch_checks
from serve.endpoints import ServeState, create_app
from tasks.batch_store import BatchStore, StoreLimits
from pipeline.runtime.sources import Requests
from tasks.serve_dir import serve_dir_problem


def line(cid, url="/v1/completions", prompt="hi"):
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"prompt": prompt, "max_tokens": 2}}


def jsonl(rows) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


class AsKey:
    """Sets request.state.key_name from an X-Test-Key header (what the authentication middleware does)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            key = dict(scope["headers"]).get(b"x-test-key")
            if key:
                scope.setdefault("state", {})["key_name"] = key.decode()
        await self.app(scope, receive, send)


def make_client(root: Path, **limits) -> tuple[TestClient, BatchStore]:
    store = BatchStore(root, StoreLimits(**limits))
    app = create_app(ServeState(Requests(8), store, "tiny", None, 200_000))
    return TestClient(AsKey(app), base_url="http://localhost"), store


def upload(client, key, rows, name="in.jsonl", **form):
    return client.post("/v1/files", headers={"X-Test-Key": key}, files={"file": (name, jsonl(rows))},
                       data={"purpose": "batch", **form})


def create(client, key, fid, **body):
    return client.post("/v1/batches", headers={"X-Test-Key": key},
                       json={"input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "24h", **body})


def test_each_key_sees_only_its_own(tmp_path):
    client, store = make_client(tmp_path / "state")
    f = upload(client, "alice", [line("a")]).json()
    b = create(client, "alice", f["id"]).json()
    assert b["status"] == "validating"
    bob = {"X-Test-Key": "bob"}
    assert client.get("/v1/files", headers=bob).json()["data"] == []
    assert client.get("/v1/batches", headers=bob).json()["data"] == []
    for method, path in [("get", f"/v1/files/{f['id']}"), ("get", f"/v1/files/{f['id']}/content"),
                         ("delete", f"/v1/files/{f['id']}"), ("get", f"/v1/batches/{b['id']}"),
                         ("post", f"/v1/batches/{b['id']}/cancel")]:
        r = getattr(client, method)(path, headers=bob)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.text)
    assert create(client, "bob", f["id"]).status_code == 400  # another key's file is no file at all
    alice = {"X-Test-Key": "alice"}
    assert [x["id"] for x in client.get("/v1/files", headers=alice).json()["data"]] == [f["id"]]
    assert client.get(f"/v1/files/{f['id']}/content", headers=alice).content == jsonl([line("a")])
    assert client.get(f"/v1/batches/{b['id']}", headers=alice).json()["id"] == b["id"]
    assert (tmp_path / "state" / "keys" / "alice" / "files" / f["id"]).is_file()
    # the unnamed key keeps the top-level folders (a server of one key reads its old state as before)
    g = upload(client, "", [line("x")]).json()
    assert (tmp_path / "state" / "files" / g["id"]).is_file()


def test_quotas_per_key(tmp_path):
    client, _ = make_client(tmp_path / "state", max_files=2, max_bytes=400)
    assert upload(client, "a", [line("1")]).status_code == 200
    assert upload(client, "a", [line("2")]).status_code == 200
    r = upload(client, "a", [line("3")])
    assert r.status_code == 429 and r.json()["error"]["type"] == "insufficient_quota"
    assert upload(client, "b", [line("1")]).status_code == 200  # another key has its own quota
    r = upload(client, "b", [line(str(i)) for i in range(10)])
    assert r.status_code == 413 and r.json()["error"]["code"] == "storage_quota_exceeded"
    fid = client.get("/v1/files", headers={"X-Test-Key": "a"}).json()["data"][0]["id"]
    assert client.delete(f"/v1/files/{fid}", headers={"X-Test-Key": "a"}).json()["deleted"]
    assert upload(client, "a", [line("3")]).status_code == 200  # room again


def test_files_expire(tmp_path, monkeypatch):
    client, store = make_client(tmp_path / "state", file_expiry_s=7200)
    bad = upload(client, "a", [line("1")], **{"expires_after[anchor]": "last_active_at",
                                              "expires_after[seconds]": "3600"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "expires_after"
    assert upload(client, "a", [line("1")], **{"expires_after[anchor]": "created_at",
                                              "expires_after[seconds]": "60"}).status_code == 400
    short = upload(client, "a", [line("1")], **{"expires_after[anchor]": "created_at",
                                               "expires_after[seconds]": "3600"}).json()
    default = upload(client, "a", [line("2")]).json()
    assert short["expires_at"] == short["created_at"] + 3600 and default["expires_at"] == default["created_at"] + 7200
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 4000)
    assert client.get(f"/v1/files/{short['id']}", headers={"X-Test-Key": "a"}).status_code == 404
    store.sweep()
    assert not (tmp_path / "state" / "keys" / "a" / "files" / short["id"]).exists()
    assert (tmp_path / "state" / "keys" / "a" / "files" / default["id"]).exists()


def test_batches_are_validated_as_openai_does(tmp_path, monkeypatch):
    client, store = make_client(tmp_path / "state")
    good = upload(client, "a", [line("1"), line("2")]).json()["id"]

    def refused(fid, code=None, **body):
        r = create(client, "a", fid, **body)
        assert r.status_code == 400, r.text
        if code:
            assert r.json()["error"]["code"] == code, r.text
        return r.json()["error"]["message"]

    assert "'24h'" in refused(good, "invalid_completion_window", completion_window="1h")
    refused(upload(client, "a", [line("1"), line("1")]).json()["id"], "duplicate_custom_id")
    assert "line 2" in refused(upload(client, "a", [line("1"), line("2", url="/v1/chat/completions")]).json()["id"],
                               "mismatched_url")
    refused(good, "invalid_metadata", metadata={f"k{i}": "v" for i in range(17)})
    refused(good, "invalid_metadata", metadata={"k" * 65: "v"})
    refused(good, "invalid_metadata", metadata={"k": "v" * 513})
    assert create(client, "a", good, metadata={f"k{i}": "v" * 512 for i in range(16)}).status_code == 200
    monkeypatch.setattr(batch_checks, "MAX_BATCH_REQUESTS", 3)
    refused(upload(client, "a", [line(str(i)) for i in range(4)]).json()["id"], "too_many_requests")
    # a batch over another batch's output file
    b = create(client, "a", good).json()
    store.fail(b["id"], "test")
    done = client.get(f"/v1/batches/{b['id']}", headers={"X-Test-Key": "a"}).json()
    refused(done["error_file_id"], "invalid_input_file")


def journal(store: BatchStore, bid: str, lines: list[dict], fingerprint: dict | None = None) -> Path:
    out = store._output(store.batches[bid])
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name("output.jsonl.partial")
    partial.write_bytes(jsonl(lines) + b'{"torn')
    if fingerprint is not None:
        partial.with_name(partial.name + ".json").write_text(json.dumps(fingerprint, sort_keys=True))
    return partial


def answered(cid, error=False):
    if error:
        return {"id": "batch_req_1", "custom_id": cid, "response": None, "error": {"message": "bad", "type": "x"}}
    return {"id": "batch_req_1", "custom_id": cid, "response": {"status_code": 200, "body": {}}, "error": None}


def contents(client, key, fid) -> list[dict]:
    text = client.get(f"/v1/files/{fid}/content", headers={"X-Test-Key": key}).text
    return [json.loads(x) for x in text.splitlines()]


def test_failed_and_expired_batches_deliver_what_they_answered(tmp_path, monkeypatch):
    client, store = make_client(tmp_path / "state")
    fid = upload(client, "a", [line(f"r{i}") for i in range(4)]).json()["id"]
    b = create(client, "a", fid).json()
    journal(store, b["id"], [answered("r0"), answered("r1", error=True)])
    store.fail(b["id"], "the server could not go on")
    got = client.get(f"/v1/batches/{b['id']}", headers={"X-Test-Key": "a"}).json()
    assert got["status"] == "failed" and got["failed_at"] and got["errors"]["data"][0]["code"] == "batch_failed"
    assert [x["custom_id"] for x in contents(client, "a", got["output_file_id"])] == ["r0"]
    errs = contents(client, "a", got["error_file_id"])
    assert [(x["custom_id"], x["error"].get("code")) for x in errs] == [
        ("r1", None), ("r2", "batch_failed"), ("r3", "batch_failed")]
    assert got["request_counts"] == {"total": 4, "completed": 1, "failed": 3}
    # a batch whose window passes before it ran ends expired, every request listed
    b2 = create(client, "a", fid).json()
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 86400 + 1)
    assert store.next_job() is None
    got = client.get(f"/v1/batches/{b2['id']}", headers={"X-Test-Key": "a"}).json()
    assert got["status"] == "expired" and got["expired_at"] and got["output_file_id"] is None
    assert {x["error"]["code"] for x in contents(client, "a", got["error_file_id"])} == {"batch_expired"}


def test_serve_dir_trusted_only_when_safe(tmp_path):
    root = tmp_path / "state"
    assert serve_dir_problem(root) is None  # created 0700 by the store
    store = BatchStore(root)
    f = store.add_file("default", jsonl([line("a")]), "a.jsonl", "batch")
    assert root.stat().st_mode & 0o777 == 0o700 and (root / "files").stat().st_mode & 0o777 == 0o700
    assert (root / "files" / f["id"]).stat().st_mode & 0o777 == 0o600
    assert (root / "files" / f"{f['id']}.json").stat().st_mode & 0o777 == 0o600
    os.chmod(root, 0o777)
    assert "can be written by other users" in serve_dir_problem(root)
    os.chmod(root, 0o700)
    os.chmod(root / "files", 0o775)
    assert "files can be written by other users" in serve_dir_problem(root)
    os.chmod(root / "files", 0o700)
    if os.geteuid() == 0:  # only root can hand a folder to another user
        os.chown(root, 12345, -1)
        assert "belongs to another user" in serve_dir_problem(root)


def test_a_serve_dir_of_another_user_is_refused_before_loading(llama_2l, tmp_path, capsys):
    import dist_inference_runner

    root = tmp_path / "open"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    code = dist_inference_runner.main(["--model-name", llama_2l, "--serve", "0", "--serve-dir", str(root)],
                                      signals=False)
    assert code == 2 and "can be written by other users" in capsys.readouterr().err


def test_planted_and_damaged_records(tmp_path):
    """A record naming a path outside the folder, or torn by a power loss, never stops the server
    starting and never makes it read outside its folder; the batch is reported failed, its answered
    lines delivered."""
    root = tmp_path / "state"
    client, store = make_client(root)
    fid = upload(client, "", [line("r0"), line("r1")]).json()["id"]
    b = create(client, "", fid).json()
    journal(store, b["id"], [answered("r0")])
    secret = tmp_path / "secret.txt"
    secret.write_text("do not serve me")
    planted = dict(b, id="batch_planted", input_file_id=str(secret), status="in_progress")
    (root / "batches" / "batch_planted.json").write_bytes(orjson.dumps(planted))
    (root / "batches" / "batch_dots.json").write_bytes(orjson.dumps(dict(planted, id="batch_dots",
                                                                         input_file_id="../../secret.txt")))
    (root / "batches" / f"{b['id']}.json").write_bytes(b"")  # what a power loss leaves
    (root / "files" / "file-empty.json").write_bytes(b'{"id": "file-em')
    (root / "files" / "file-other.json").write_bytes(orjson.dumps({"id": "/etc/passwd", "purpose": "batch",
                                                                   "bytes": 1, "created_at": 1}))
    client, store = make_client(root)  # a restart
    assert store.next_job() is None  # nothing runs from a planted or damaged record
    listed = {x["id"]: x for x in client.get("/v1/batches").json()["data"]}
    assert {listed[i]["status"] for i in ("batch_planted", "batch_dots", b["id"])} == {"failed"}
    assert "damaged" in listed[b["id"]]["errors"]["data"][0]["message"]
    assert [x["custom_id"] for x in contents(client, "", listed[b["id"]]["output_file_id"])] == ["r0"]
    assert [x["id"] for x in client.get("/v1/files").json()["data"]].count(fid) == 1
    for x in listed.values():
        for out in (x["output_file_id"], x["error_file_id"]):
            if out:
                assert "do not serve me" not in client.get(f"/v1/files/{out}/content").text
    assert str(root) not in json.dumps(listed) and str(tmp_path) not in json.dumps(listed)


def test_list_batches_reads_under_the_lock(tmp_path):
    client, store = make_client(tmp_path / "state")
    fid = upload(client, "", [line("r0")]).json()["id"]
    create(client, "", fid)
    seen = []
    copy = store._copy
    store._copy = lambda b: (seen.append(store.lock._is_owned()), copy(b))[1]
    assert len(client.get("/v1/batches").json()["data"]) == 1 and seen == [True]


# -- the engine's batch decisions (the engine over the store's jobs, without a pipeline) ------------

class FakeDriver(SimpleNamespace):
    def fill(self):
        self.filled += 1

    def take_errors(self):
        return []

    def take_released(self):
        return []

    def start(self, lines, suspects=(), culprits=()):
        self.lines = lines


def engine_for(store: BatchStore, fingerprint: dict):
    from pipeline.runtime.engine import Engine
    from serve.batch_jobs import BatchJobs

    driver = FakeDriver(lines=None, held=None, filled=0, error_kinds={}, exhausted=False, requests_read=0,
                        encode_seconds=0.0, padding_ratio=0.0, queued=0, slot_ids=range(1), prefix=None,
                        group_of=lambda slot, row: None)
    stage = SimpleNamespace(busy=0.0, peak_cells=0, kv_cells=0, gpu_peak_mb=lambda: [], memory_mb=lambda: {},
                            precision=lambda: {}, release=lambda slots: None, add_figures=lambda msg: None)
    eng = Engine(stage, driver, None, SimpleNamespace(), files=BatchJobs(store, fingerprint))
    eng.sent = []
    eng._down = eng.sent.append
    return eng


def step(eng) -> None:
    """One turn of the engine's file step, the store looked at afresh (its state is polled a few times a second)."""
    eng._polled = float("-inf")
    eng._file_step()


def test_restart_with_another_setting_delivers_the_answered_lines(tmp_path):
    """A journal written under another --seed fails its batch, delivering what it answered, with a
    message that names no server path (the log has the details)."""
    from serve.batch_jobs import SETTINGS_CHANGED
    from tasks.files import input_fingerprint

    client, store = make_client(tmp_path / "state")
    fid = upload(client, "a", [line("r0"), line("r1")]).json()["id"]
    b = create(client, "a", fid).json()
    old = {"model": "/models/x", "seed": 1}
    inp = store._dir("a", "files") / fid
    journal(store, b["id"], [answered("r0")], dict(old, input=input_fingerprint(inp)))
    eng = engine_for(store, dict(old, seed=2))
    step(eng)
    assert eng.sent == [] and eng.job is None
    got = client.get(f"/v1/batches/{b['id']}", headers={"X-Test-Key": "a"}).json()
    assert got["status"] == "failed" and got["errors"]["data"][0]["message"] == SETTINGS_CHANGED
    assert [x["custom_id"] for x in contents(client, "a", got["output_file_id"])] == ["r0"]
    assert [x["custom_id"] for x in contents(client, "a", got["error_file_id"])] == ["r1"]
    assert "/" not in SETTINGS_CHANGED
    # the same settings resume it
    b2 = create(client, "a", fid).json()
    journal(store, b2["id"], [answered("r0")], dict(old, input=input_fingerprint(inp)))
    eng = engine_for(store, old)
    step(eng)
    assert eng.job is not None and type(eng.sent[0]).__name__ == "OpenFile"


def test_a_running_batch_expires_with_its_answers_and_a_full_disk_pauses(tmp_path, monkeypatch):
    from pipeline.runtime.engine import FileRun
    from pipeline.runtime.messages import Closed, Opened

    client, store = make_client(tmp_path / "state")
    fid = upload(client, "a", [line(f"r{i}") for i in range(3)]).json()["id"]
    b = create(client, "a", fid).json()
    eng = engine_for(store, {"seed": 1})
    step(eng)
    eng._opened(Opened(0))
    assert isinstance(eng.job, FileRun) and eng.driver.lines is not None
    step(eng)
    assert eng.driver.filled == 1
    monkeypatch.setattr(store, "disk_low", lambda: True)  # paused: no new lines are read
    step(eng)
    assert eng.driver.filled == 1
    monkeypatch.setattr(store, "disk_low", lambda: False)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 86401)
    eng.driver.requests_read, eng.job.done, eng.driver.exhausted = 1, 1, True
    step(eng)
    assert eng.job.expiring and eng.driver.lines is None and type(eng.sent[-1]).__name__ == "CloseFile"
    assert eng.sent[-1].total == 1  # what was read: the writer publishes the answered prefix
    out = store._output(store.batches[b["id"]])
    out.write_bytes(jsonl([answered("r0")]))
    summary = SimpleNamespace(errors=0, error_kinds={}, prompt_tokens=0, completion_tokens=0)
    eng._closed(Closed(True, summary))
    got = client.get(f"/v1/batches/{b['id']}", headers={"X-Test-Key": "a"}).json()
    assert got["status"] == "expired"
    assert [x["custom_id"] for x in contents(client, "a", got["output_file_id"])] == ["r0"]
    assert [(x["custom_id"], x["error"]["code"]) for x in contents(client, "a", got["error_file_id"])] == [
        ("r1", "batch_expired"), ("r2", "batch_expired")]
    # a full disk never opens the next batch
    create(client, "a", fid)
    monkeypatch.setattr(store, "disk_low", lambda: True)
    step(eng)
    assert eng.job is None


def test_a_full_disk_answers_503_and_the_server_goes_on(tmp_path, monkeypatch):
    import errno

    from tasks import files

    client, store = make_client(tmp_path / "state")
    real = files.write_atomic

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path))

    monkeypatch.setattr("tasks.batch_store.write_atomic", full)
    r = upload(client, "a", [line("1")])
    assert r.status_code == 503 and str(tmp_path) not in r.text
    monkeypatch.setattr("tasks.batch_store.write_atomic", real)
    assert upload(client, "a", [line("1")]).status_code == 200


def test_ended_batches_and_their_outputs_go_after_the_retention(tmp_path, monkeypatch):
    client, store = make_client(tmp_path / "state", retention_s=3600)
    fid = upload(client, "a", [line("r0")]).json()["id"]
    b = create(client, "a", fid).json()
    journal(store, b["id"], [answered("r0")])
    store.fail(b["id"], "stop")
    got = client.get(f"/v1/batches/{b['id']}", headers={"X-Test-Key": "a"}).json()
    out = client.get(f"/v1/files/{got['output_file_id']}", headers={"X-Test-Key": "a"}).json()
    assert out["expires_at"] == out["created_at"] + 3600
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 3601)
    store.sweep()
    assert client.get(f"/v1/batches/{b['id']}", headers={"X-Test-Key": "a"}).status_code == 404
    assert client.get(f"/v1/files/{got['output_file_id']}", headers={"X-Test-Key": "a"}).status_code == 404
    left = sorted(p.name for p in (tmp_path / "state" / "keys" / "a").rglob("*") if p.is_file())
    assert left == [fid, f"{fid}.json"]  # the upload keeps its own, longer expiry


def test_state_of_an_earlier_version_is_read(tmp_path):
    """Records written before keys and expiry (top-level folders, "expires_at": null) load as the
    unnamed key's, with the default expiry."""
    root = tmp_path / "state"
    (root / "files").mkdir(parents=True)
    (root / "files" / "file-old").write_bytes(jsonl([line("a")]))
    (root / "files" / "file-old.json").write_bytes(orjson.dumps(
        {"id": "file-old", "object": "file", "bytes": 10, "created_at": int(time.time()), "filename": "a.jsonl",
         "purpose": "batch", "status": "processed", "expires_at": None, "status_details": None}))
    client, store = make_client(root, file_expiry_s=7200)
    got = client.get("/v1/files/file-old").json()
    assert got["expires_at"] == got["created_at"] + 7200
    assert create(client, "", "file-old").status_code == 200
