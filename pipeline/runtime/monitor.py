"""Seeing a file-mode run from outside: the status file and ``--metrics-port`` on the writing rank.

The stages' figures reach it in band: every ``--status-interval`` seconds rank 0 marks a pass
(``PassHeader.stats``), each stage appends its figures after its forward, and the last rank reads them
and sends them back to rank 0 in the reply (serve mode's /metrics).
"""

from __future__ import annotations

import logging
from pathlib import Path

import dataclasses

from tasks.status_exporter import StatusCollector
from tasks.shards import share_size
from tasks.files import count_lines
from tasks.status import RunStatus, activate

from pipeline.config.options import RunOptions
from pipeline.config.plan import output_for

log = logging.getLogger("runner")


def status_path(opts, inputs: list[str], data_rank: int = 0, data_size: int = 1) -> str | None:
    """``--status-file`` (``none``: off), else ``<output>.status.json`` beside the one output, or
    ``status.json`` in the first output's folder for several inputs; ``-<d>-of-<D>`` per data group."""
    if opts.status_file == "none" or (opts.status_file is None and not inputs):
        return None
    path = opts.status_file
    if path is None:
        first = output_for(inputs[0], opts.output_path, len(inputs) > 1)
        path = first + ".status.json" if len(inputs) == 1 else str(Path(first).parent / "status.json")
    return f"{path.removesuffix('.json')}-{data_rank}-of-{data_size}.json" if data_size > 1 else path


def start_status(plan, opts, info) -> RunStatus | None:
    """The writing rank's status file, in state ``loading``, with its heartbeat running (None elsewhere
    and in serve mode)."""
    if opts.serve is not None or not info.is_last:
        return None
    inputs = list(plan.all_inputs)
    path = status_path(opts, inputs, info.data_rank, info.data_size)
    if path is None:
        return None
    several = len(inputs) > 1
    files = []
    for i in inputs:
        try:
            total = share_size(info.data_rank, count_lines(i), info.data_size)
        except OSError:  # an input only rank 0 can read (no shared filesystem): its total comes with OpenFile
            total = None
        files.append((i, output_for(i, opts.output_path, several), total))
    record = dict(plan.fingerprint, model_name=plan.model_name, flags=run_flags(opts),
                  pipeline_size=info.pipeline_size, data_group_size=info.data_size, data_rank=info.data_rank)
    status = RunStatus(path, record, files, opts.status_interval, info.pipeline_size)
    status.start()
    activate(status)
    log.info("status file: %s (every %ds)", path, opts.status_interval)
    return status


def run_flags(opts) -> dict:
    """The options that differ from their defaults (the run record's ``flags``), keys hidden."""
    defaults = RunOptions()
    return {f.name: "<hidden>" if "key" in f.name else value for f in dataclasses.fields(RunOptions)
            if (value := getattr(opts, f.name)) != getattr(defaults, f.name)}


def start_metrics(opts, status: RunStatus | None):
    """``--metrics-port``: Prometheus metrics from the status figures on 127.0.0.1:PORT (+ the data rank: a
    daemon thread) while the run lasts; the server, for :func:`stop_metrics` (None without the flag)."""
    if opts.metrics_port is None or status is None:
        return None
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(StatusCollector(status))
    port = opts.metrics_port + status.record["data_rank"]  # each data group's writer: a port of its own
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    log.info("metrics: http://127.0.0.1:%d/metrics", port)
    return server


def stop_metrics(server) -> None:
    """The run ended: its port is closed (a process ends anyway; an ``--in-process`` run's caller goes on)."""
    if server is not None:
        server.shutdown()
        server.server_close()
