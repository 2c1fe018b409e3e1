"""Serve mode: an OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of rank 0's driver.

- :mod:`serve.source`   the thread-safe handoff between HTTP handlers and the pipeline loop, admission;
- :mod:`serve.engine`   rank 0's loop: live requests first, then the lines of the running batch;
- :mod:`serve.batches`  the Batch API's files and batches, kept in ``--serve-dir``;
- :mod:`serve.app`      the HTTP endpoints; :mod:`serve.sse` the streamed chunk format;
- :mod:`serve.guard`    checks before any handler: Host/Origin, keys, media type, body size;
- :mod:`serve.auth`     API keys and their names, the Host/Origin allow-lists;
- :mod:`serve.intake`   per-request caps before tokenizing, tokenizing on worker threads;
- :mod:`serve.protocol` the connection cap and the header/body/send timeouts (uvicorn's h11 protocol);
- :mod:`serve.upload`   ``POST /v1/files`` parsed and written to disk as it arrives;
- :mod:`serve.responses` JSON answers in OpenAI's shapes, bodies read under a size limit;
- :mod:`serve.metrics`  Prometheus metrics at ``/metrics`` (requests, load, tokens, latencies, stages).

The other faces of the same engine (docs/usage/chat.md):

- :mod:`serve.local`    rank 0's own requests into :mod:`serve.engine` on a pipeline thread (no HTTP);
- :mod:`serve.prompts`  ``--prompts`` / ``--prompts-file``: completions and a latency report;
- :mod:`serve.chat_shell` the ``--chat`` shell (conversation, commands, trimming to the window), its
  :mod:`serve.chat_terminal` (readline, Ctrl-C as a key) and :mod:`serve.chat_backends` (this process's
  pipeline, or a running server over HTTP); :mod:`serve.interactive` starts them;
- :mod:`serve.web_page` the chat page at ``/`` (``serve/static/index.html``).

May import every pipeline package, tasks and comm; nothing imports serve but the entry point.
"""
