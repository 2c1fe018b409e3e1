"""Serve mode's HTTP server: an OpenAI-compatible API (FastAPI + uvicorn) in front of rank 0's engine
(README.md lists the modules). A face of the engine: may import pipeline, tasks and comm; nothing imports
serve but the entry point.
"""
