"""Rank 0's side of ``--prompts`` / ``--prompts-file`` / ``--chat``, and ``--chat --url`` (no model here).

The other ranks run their usual serve-mode loop (``pipeline.runtime.roles.serve_rank``): to them a
prompt or a chat turn is one more live request, as for an HTTP client.
"""

from __future__ import annotations

import sys

from terminal.chat_backends import BackendError, HttpBackend, LocalBackend
from terminal.chat_shell import ChatShell
from terminal.local_engine import LocalEngine
from terminal.prompts import run_prompts


def run_interactive(rank, stopping=None) -> int:
    """Rank 0: the engine on its thread, the terminal on this one; stops every rank at the end."""
    opts, plan = rank.opts, rank.plan
    engine = LocalEngine(rank, stopping)
    code = 1
    try:
        if opts.chat:
            backend = LocalBackend(engine, plan.model_name, [a.name for a in plan.adapters])
            code = ChatShell(backend, opts).run()
        else:
            code = run_prompts(engine, opts)
    finally:
        engine.thread.stop(60)
    if engine.thread.failure is not None:
        raise RuntimeError(engine.thread.failure)
    return code


def run_chat_client(opts) -> int:
    """``--chat --url``: the shell on a running server; exit 1 when it cannot be reached."""
    try:
        backend = HttpBackend(opts.url, opts.api_key)
    except BackendError as e:
        print(f"dist_inference_runner.py: {e}", file=sys.stderr)
        return 1
    return ChatShell(backend, opts).run()
