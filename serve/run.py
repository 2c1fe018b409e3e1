"""Start serve mode on rank 0: the batch store, the HTTP thread, then the pipeline loop until SIGTERM."""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
import tempfile

log = logging.getLogger("serve")

API_KEY_ENV = "DIST_INFER_API_KEY"


def run_server(plan, opts, info, stage, first_rank) -> None:
    """``first_rank`` builds rank 0's driver pieces (pipeline.roles.first_rank)."""
    from pipeline.options import serve_address

    from .app import HttpThread, ServeState, create_app
    from .batches import BatchStore
    from .engine import ServeRank
    from .source import RequestSource

    host, port = serve_address(opts.serve)
    api_key = opts.api_key or os.environ.get(API_KEY_ENV) or None
    if not api_key and not _loopback(host):
        log.warning("serving on %s without an API key: anyone who can reach this address can use it; "
                    "pass --api-key or set %s", host, API_KEY_ENV)
    os.umask(0o077)  # prompts and results: this user's only (the state folder is 0700, its files 0600)
    root = opts.serve_dir
    if root is None:
        root = tempfile.mkdtemp(prefix="dist-infer-serve-")
        log.warning("no --serve-dir: uploaded files and batches go to %s and are not resumed after a restart", root)
    fr = first_rank(plan, opts, info, stage)
    fr.driver.sched.headroom = True
    source, store = RequestSource(opts.max_pending), BatchStore(root, store_limits(opts))
    name = opts.served_model_name or plan.model_name
    engine = ServeRank(fr.stage, fr.driver, fr.link, fr.last, source, store)
    engine.fingerprint = plan.fingerprint
    adapters = tuple(a.name for a in plan.adapters)
    http = HttpThread(create_app(ServeState(source, store, name, api_key, opts.max_request_bytes, adapters=adapters)),
                      host, port)
    http.start()
    bound = http.server.servers[0].sockets[0].getsockname()[1] if http.server.servers else port
    print(f"serving {name} on http://{host}:{bound}/v1 (P = {info.pipeline_size})", file=sys.stderr, flush=True)
    try:
        engine.serve()
    finally:
        http.stop()
    log.info("server stopped")


def store_limits(opts):
    """The Batch API's per-key quotas and lifetimes from the flags."""
    from .batches import StoreLimits

    return StoreLimits(opts.key_storage_bytes, opts.key_max_files, int(opts.file_expiry_hours * 3600),
                       int(opts.batch_retention_hours * 3600), opts.min_free_disk_bytes)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
