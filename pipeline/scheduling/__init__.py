"""Rank 0's decisions, pure CPU: request intake (read, validate, tokenize), the scheduler that packs rows
into micro-batches under the KV budget and returns complete, immutable passes (its policies in policy,
what it works with in batches), and the driver, the scheduler's only caller, that turns each pass into a
header and input ids.

May import: pipeline.cache (the prefix index), pipeline.runtime.messages (what a pass is), tasks (request
parsing), pipeline.config.components (its config type). Never torch.distributed, pipeline.models or serve.
"""
