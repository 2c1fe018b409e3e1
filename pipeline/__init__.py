"""The inference pipeline, in packages by role (each package's docstring says what it may import):

config (options, plan, stage memory, budget) -> scheduling (rank 0: intake, scheduler, driver) ->
runtime (each rank's loop, the stage step, links, messages) over cache (KV cache, prefix cache),
loading (checkpoints, tokenizers, adapters), sampling (logits -> tokens), output (stops, best_of,
OpenAI objects) and models (decoder, families/, kernels/), which knows nothing of ranks or options.
The faces (serve/, terminal/, python_api/) sit on top: they feed rank 0's engine and nothing here imports them.
"""
