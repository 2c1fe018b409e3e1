"""The jobs' I/O (the design card's name): request files in (completions, chat, Batch API lines),
validation of request fields, OpenAI's error and answer objects (protocol), the ordered resumable
writer, atomic files, shards for data parallelism, progress, the live status file and its Prometheus
form, in-flight records that prevent crash loops, dummy-data mode, and the Batch API's store.

May import comm only; nothing of pipeline, and no face.
"""
