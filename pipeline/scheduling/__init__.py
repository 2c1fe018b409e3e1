"""Rank 0's decisions, pure CPU: request intake (read, validate, tokenize, chat templates), the scheduler
that packs rows into micro-batches under the KV budget and returns complete, immutable passes
(scheduler; its sizes and file/serve policies in policy; what it works with in
batches), and the driver that turns each pass into a header and input ids (the only caller of the
scheduler: rank 0's loops and the server talk to the driver).

May import: pipeline.cache (the prefix index), pipeline.runtime.messages (what a pass is), tasks (request
parsing), pipeline.config.components (its config type). Never torch.distributed, pipeline.models or serve.
"""
