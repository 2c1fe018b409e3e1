"""The jobs' I/O: request files in, the ordered resumable writer, status files and the Batch API's store
(README.md lists the modules). May import comm only; nothing of pipeline, and no face.
"""
