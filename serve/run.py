"""Start serve mode on rank 0: the batch store, the HTTP thread, then the pipeline loop until SIGTERM."""

from __future__ import annotations

import logging
import os
import sys
import tempfile

from serve.auth import API_KEY_ENVS, loopback
from pipeline.config.options import serve_address
from serve.app import HttpThread, ServeState, create_app
from serve.auth import load_keys, make_access
from serve.batches import BatchStore
from serve.engine import ServeRank
from serve.metrics import ServeMetrics
from serve.intake import Caps, Tokenizing, max_token_bytes
from serve.protocol import Limits, connection_cap
from serve.source import RequestSource
from serve.batches import StoreLimits

log = logging.getLogger("serve")

API_KEY_ENV = API_KEY_ENVS[0]
_loopback = loopback  # tests import it from here


def run_server(plan, opts, info, stage, first_rank) -> None:
    """``first_rank`` builds rank 0's driver pieces (pipeline.runtime.roles.first_rank)."""


    host, port = serve_address(opts.serve)
    keys = load_keys(opts.api_key, getattr(opts, "api_key_file", None))
    if not keys and not loopback(host):
        log.warning("serving on %s without an API key: anyone who can reach this address can use it; "
                    "pass --api-key-file or set %s", host, API_KEY_ENV)
    os.umask(0o077)  # prompts and results: this user's only (the state folder is 0700, its files 0600)
    root = opts.serve_dir
    if root is None:
        root = tempfile.mkdtemp(prefix="dist-infer-serve-")
        log.warning("no --serve-dir: uploaded files and batches go to %s and are not resumed after a restart", root)
    fr = first_rank(plan, opts, info, stage)  # opts.serve: its scheduler runs the serve policy
    source, store = RequestSource(opts.max_pending, opts.max_pending_rows), BatchStore(root, store_limits(opts))
    name = opts.served_model_name or plan.served_name
    engine = ServeRank(fr.stage, fr.driver, fr.link, fr.last, source, store)
    engine.fingerprint = plan.fingerprint
    engine.metrics = metrics = ServeMetrics()
    engine.stats_every = opts.status_interval  # passes bring the stages' figures back for /metrics
    driver = fr.driver
    caps = Caps(opts.max_prompts_per_request, opts.max_pending_rows, driver.max_positions, max_token_bytes(driver.tok),
                opts.truncate_prompts)
    tokenizing = Tokenizing(driver.tok, driver.encode_prompts)
    state = ServeState(source, store, name, keys, opts.max_request_bytes, opts.max_upload_bytes,
                       adapters=tuple(a.name for a in plan.adapters), access=make_access(host, opts.allowed_hosts,
                       opts.allowed_origins), allowed_origins=opts.allowed_origins, caps=caps, tokenizing=tokenizing,
                       metrics=metrics)
    limits = Limits(connection_cap(opts.max_connections), opts.header_timeout, opts.body_timeout, opts.send_timeout)
    http = HttpThread(create_app(state), host, port, limits, opts.keep_alive_timeout)
    http.start()
    bound = http.server.servers[0].sockets[0].getsockname()[1] if http.server.servers else port
    print(f"serving {name} on http://{host}:{bound}/v1 (P = {info.pipeline_size})", file=sys.stderr, flush=True)
    try:
        engine.serve()
    finally:
        http.stop()
        tokenizing.close()
    log.info("server stopped")


def store_limits(opts):
    """The Batch API's per-key quotas and lifetimes from the flags."""

    return StoreLimits(opts.key_storage_bytes, opts.key_max_files, int(opts.file_expiry_hours * 3600),
                       int(opts.batch_retention_hours * 3600), opts.min_free_disk_bytes)
