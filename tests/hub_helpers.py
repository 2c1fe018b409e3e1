"""Test helpers for hub ids without any network: a tiny model in hand-picked safetensors shards, a
HuggingFace cache laid out as huggingface_hub lays it out (``models--org--name/{refs,snapshots,blobs}``),
and :class:`HubServer`, a 127.0.0.1 server answering the endpoints huggingface_hub calls
(``/api/models/{id}/revision/{rev}``, HEAD/GET ``/{id}/resolve/{rev}/{file}`` with ETag, X-Repo-Commit,
Range), recording every request and able to cut a download off mid-body."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

from safetensors.torch import load_file, save_file

from tests.utils import tiny_llama

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def sharded_llama(out: Path, seed: int = 0) -> Path:
    """A 4-layer tiny Llama in three shards: embeddings + layer 0, layers 1-2, layer 3 + norm + head.
    At P = 2 (layers 0-1 | 2-3) stage 0 reads shards 1-2 and stage 1 shards 2-3: the middle one is shared."""
    folder = Path(tiny_llama(out, seed=seed, num_hidden_layers=4))
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()

    def shard(name: str) -> int:
        m = re.search(r"\.layers\.(\d+)\.", name)
        layer = int(m.group(1)) if m else (-1 if "embed" in name else 4)
        return 1 if layer <= 0 else 2 if layer <= 2 else 3

    weight_map = {}
    for k in (1, 2, 3):
        fname = f"model-0000{k}-of-00003.safetensors"
        part = {n: t.contiguous() for n, t in tensors.items() if shard(n) == k}
        save_file(part, folder / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def etag(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_cache(cache: Path, repo_id: str, folder: Path, commit: str = COMMIT, refs: tuple[str, ...] = ("main",),
                skip: tuple[str, ...] = ()) -> Path:
    """Put ``folder``'s files into ``cache`` as huggingface_hub does (blobs by etag, snapshot symlinks,
    refs naming the commit); ``skip``: files left out (a partial snapshot). Returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for f in sorted(folder.iterdir()):
        if not f.is_file() or f.name in skip:
            continue
        blob = repo / "blobs" / etag(f)
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snap / f.name
        if not link.exists():
            os.symlink(os.path.relpath(blob, snap), link)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snap


class HubServer:
    """A local hub: ``repos[repo_id] = {"commits": {commit: folder}, "refs": {branch: commit}, "gated": bool}``
    (``"refused": 401`` or ``403``: the hub refuses the token).

    ``requests`` records ``(who, method, file, range header)`` for resolve calls and ``(who, "API", path, None)``
    for API calls, where ``who`` is an endpoint prefix (``HF_ENDPOINT=http://127.0.0.1:PORT/r0`` -> ``r0``),
    so ranks given their own prefix can be told apart. ``cut[file] = n``: the first GET of ``file`` sends
    its full Content-Length but only ``n`` bytes, then closes the connection."""

    def __init__(self, repos: dict):
        self.repos, self.requests, self.cut = repos, [], {}
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                server.handle(self, head=True)

            def do_GET(self):
                server.handle(self, head=False)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def endpoint(self, who: str = "") -> str:
        return f"http://127.0.0.1:{self.port}" + (f"/{who}" if who else "")

    def gets(self, who: str | None = None) -> list[str]:
        return [f for w, m, f, _ in self.requests if m == "GET" and (who is None or w == who)]

    def touched(self, who: str | None = None) -> set[str]:
        """Files this client asked about (HEAD or GET)."""
        return {f for w, m, f, _ in self.requests if m in ("GET", "HEAD") and (who is None or w == who)}

    def _reply(self, h, status: int, headers: dict, body: bytes = b"", head: bool = False) -> None:
        h.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            h.send_header(k, v)
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _error(self, h, status: int, code: str, head: bool) -> None:
        self._reply(h, status, {"X-Error-Code": code, "Content-Type": "application/json"},
                    json.dumps({"error": code}).encode(), head)

    def handle(self, h, head: bool) -> None:
        path = unquote(h.path.split("?", 1)[0])
        who = ""
        m = re.match(r"^/(r\d+)(/.*)$", path)
        if m:
            who, path = m.group(1), m.group(2)
        api = re.match(r"^/api/models/([^/]+/[^/]+)/revision/(.+)$", path)
        res = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        repo_id = (api or res).group(1) if (api or res) else None
        with self.lock:
            method = "API" if api else h.command if res else "OTHER"  # OTHER: calls no test counts
            self.requests.append((who, method, res.group(3) if res else path, h.headers.get("Range")))
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._error(h, 401, "RepoNotFound", head)
        if repo.get("refused"):  # a token the hub does not accept (401) or one not allowed to read it (403)
            return self._reply(h, repo["refused"], {"X-Error-Message": "Invalid credentials in Authorization header"},
                               head=head)
        if repo.get("gated"):
            return self._error(h, 401, "GatedRepo", head)
        rev = (api or res).group(2)
        commit = rev if rev in repo["commits"] else repo["refs"].get(rev)
        if commit is None:
            return self._error(h, 404, "RevisionNotFound", head)
        folder = Path(repo["commits"][commit])
        if api:
            files = sorted(f.name for f in folder.iterdir() if f.is_file())
            body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                               "siblings": [{"rfilename": f} for f in files]}).encode()
            return self._reply(h, 200, {"Content-Type": "application/json"}, body)
        self._file(h, folder / res.group(3), commit, head)

    def _file(self, h, file: Path, commit: str, head: bool) -> None:
        if not file.is_file():
            return self._error(h, 404, "EntryNotFound", head)
        data = file.read_bytes()
        headers = {"X-Repo-Commit": commit, "ETag": f'"{etag(file)}"', "Accept-Ranges": "bytes"}
        start = 0
        rng = h.headers.get("Range")
        if rng and not head:
            start = int(re.match(r"bytes=(\d+)-", rng).group(1))
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        cut = None
        with self.lock:
            if not head and file.name in self.cut:
                cut = self.cut.pop(file.name)
        if cut is None:
            return self._reply(h, status, headers, body, head)
        h.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(body[:cut])
        h.wfile.flush()
        h.close_connection = True
