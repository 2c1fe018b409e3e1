"""Device work on the last stage after its layers: logits to tokens and logprobs for a whole
micro-batch with per-row parameters.

May import torch only (and pipeline.models.kernels). Never output, runtime or serve.
"""
