"""Each rank's loop and what connects them: rank 0's engine and its request sources (engine, sources, engine_thread), the stage step every rank runs
(stage), the last rank's answers (last_rank), the typed messages and links between neighbours, and
the factory that builds a rank from the plan (roles), the status file and --metrics-port on the
writing rank (monitor), each stage's memory account (memory).

May import every pipeline package and comm; only the faces (serve, terminal, python_api) and the entry point import it.
"""
