"""Start serve mode on rank 0: the batch store, the HTTP thread, then the engine until it is stopped."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

from pipeline.config.options import serve_address
from pipeline.runtime.roles import make_engine
from pipeline.runtime.sources import Requests
from serve.endpoints import HttpThread, ServeState, create_app
from serve.auth import API_KEY_ENVS, load_keys, loopback, make_access
from serve.batch_jobs import BatchJobs
from tasks.batch_store import BatchStore, StoreLimits
from serve.tokenizing import Caps, Tokenizing, max_token_bytes
from serve.metrics import ServeMetrics
from serve.connection_limits import Limits, connection_cap

log = logging.getLogger("serve")

API_KEY_ENV = API_KEY_ENVS[0]


def run_server(rank, stopping) -> None:
    """Rank 0 of serve mode (``rank``: pipeline.runtime.roles.Rank): the HTTP thread, and the engine on
    this thread, fed by HTTP clients and the Batch API's store, until ``stopping`` (then drained)."""
    plan, opts = rank.plan, rank.opts
    host, port = serve_address(opts.serve)
    keys = load_keys(opts.api_key, getattr(opts, "api_key_file", None))
    if not keys and not loopback(host):
        log.warning("serving on %s without an API key: anyone who can reach this address can use it; "
                    "pass --api-key-file or set %s", host, API_KEY_ENV)
    os.umask(0o077)  # prompts and results: this user's only (the state folder is 0700, its files 0600)
    root, temporary = opts.serve_dir, opts.serve_dir is None
    if temporary:
        root = tempfile.mkdtemp(prefix="dist-infer-serve-")
        log.warning("no --serve-dir: uploaded files and batches go to %s and are removed when the server stops", root)
    source = Requests(opts.max_pending, opts.max_pending_rows, stopping)
    store = BatchStore(root, StoreLimits(opts.key_storage_bytes, opts.key_max_files, int(opts.file_expiry_hours * 3600),
                                         int(opts.batch_retention_hours * 3600), opts.min_free_disk_bytes))
    engine = make_engine(rank, BatchJobs(store, plan.fingerprint), source, stopping)  # --serve: serve mode's policy
    engine.metrics = metrics = ServeMetrics()
    driver = engine.driver
    name = opts.served_model_name or plan.served_name
    caps = Caps(opts.max_prompts_per_request, opts.max_pending_rows, driver.max_positions, max_token_bytes(driver.tok),
                opts.truncate_prompts)
    tokenizing = Tokenizing(driver.tok, driver.encode_prompts)
    state = ServeState(source, store, name, keys, opts.max_request_bytes, opts.max_upload_bytes,
                       adapters=tuple(a.name for a in plan.adapters), access=make_access(host, opts.allowed_hosts,
                       opts.allowed_origins), allowed_origins=opts.allowed_origins, caps=caps, tokenizing=tokenizing,
                       metrics=metrics, lenient_fields=opts.lenient_fields, max_model_len=driver.max_positions,
                       vocab_size=driver.vocab_size)
    limits = Limits(connection_cap(opts.max_connections), opts.header_timeout, opts.body_timeout, opts.send_timeout)
    http = HttpThread(create_app(state), host, port, limits, opts.keep_alive_timeout)
    http.start()
    bound = http.server.servers[0].sockets[0].getsockname()[1] if http.server.servers else port
    print(f"serving {name} on http://{host}:{bound}/v1 (P = {rank.info.pipeline_size})", file=sys.stderr, flush=True)
    try:
        engine.run()
    finally:
        http.stop()
        tokenizing.close()
        if temporary:
            shutil.rmtree(root, ignore_errors=True)
    log.info("server stopped")
