"""Serve mode's HTTP server: an OpenAI-compatible API (FastAPI + uvicorn) in front of rank 0's engine.

- :mod:`serve.server`       start serve mode on rank 0: the store, the HTTP thread, the engine;
- :mod:`serve.endpoints`    the HTTP endpoints and the uvicorn thread; :mod:`serve.sse` the streamed chunk format;
- :mod:`serve.http_channel` an HTTP request's way back from the engine (asyncio futures and queues);
- :mod:`serve.batch_routes` ``/v1/files`` and ``/v1/batches`` over the Batch API's store (tasks.batch_store);
- :mod:`serve.batch_jobs`   that store as the engine's file source;
- :mod:`serve.guard`, :mod:`serve.auth`, :mod:`serve.connection_limits`: what every request passes
  (Host/Origin, keys, media type, body size; the connection cap and timeouts);
- :mod:`serve.tokenizing`   caps before tokenizing, tokenizing off the engine's thread;
- :mod:`serve.file_upload`, :mod:`serve.responses`, :mod:`serve.metrics`, :mod:`serve.web_page`.

A face of the engine: may import pipeline, tasks and comm; nothing imports serve but the entry point.
"""
