"""Rank 0's decisions, pure CPU: request intake (read, validate, tokenize, chat templates), the scheduler
that packs rows into micro-batches under the KV budget, and the driver that turns its decisions into
passes.

May import: pipeline.cache (the prefix index), pipeline.runtime.messages (what a pass is), tasks (request
parsing). Never torch.distributed, pipeline.models or serve.
"""
