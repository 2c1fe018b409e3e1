"""Each rank's loop and what connects them: rank 0's engine and its request sources, the stage step
every rank runs, the last rank's answers, the messages and links between neighbours, the factory that
builds a rank from the plan (roles), the status file and --metrics-port, each stage's memory account.

May import every pipeline package and comm; only the faces (serve, terminal, python_api) and the entry point import it.
"""
