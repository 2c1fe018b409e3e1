"""Device work on the last stage after its layers: logits to tokens and logprobs for a whole
micro-batch with per-row parameters (sampler, step), echo scoring (scoring) and structured outputs'
token masks (grammar).

May import torch, pipeline.loading.upload and pipeline.models.kernels. Never tasks, output, runtime,
scheduling or serve.
"""
