"""KV memory: the preallocated KV cache of a micro-batch on one stage (kv_cache) and the shared-prefix
cache: rank 0's index of resident blocks and every stage's pool of their keys and values (prefix).

May import pipeline.models.kernels (native copies). Never the runtime, scheduling or options.
"""
