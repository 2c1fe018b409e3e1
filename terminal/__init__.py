"""The terminal's faces of the engine: ``--prompts`` and the ``--chat`` shell, on the pipeline loaded in
this process or on a running server. May import pipeline, tasks and comm; only the entry point imports it."""
