"""Serve mode: an OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of rank 0's driver.

- :mod:`serve.source`  the thread-safe handoff between HTTP handlers and the pipeline loop;
- :mod:`serve.engine`  rank 0's loop: live requests first, then the lines of the running batch;
- :mod:`serve.batches` the Batch API's files and batches, kept in ``--serve-dir``;
- :mod:`serve.app`     the HTTP endpoints; :mod:`serve.sse` the streamed chunk format.
"""
