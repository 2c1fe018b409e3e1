"""The jobs' I/O (the design card's name): request files in (completions, chat, Batch API lines),
validation of request fields, the ordered resumable writer, atomic files, shards for data
parallelism, progress, the live status file (status) and its Prometheus form (metrics), in-flight
records that prevent crash loops, and dummy-data mode.

May import comm and pipeline's lower layers; never pipeline.runtime or serve.
"""
