"""Model code that knows nothing of ranks, files or options: the config-driven decoder (spec, decoder,
positions, MoE, LoRA math, segments), the generic stage on transformers' own layers, families/ (one
module per family: HF config and tensor names -> spec and sources) and kernels/ (native C, int8,
oneDNN-packed, batch-invariant, SDPA forms, prefill without padding, the head's matmul).

May import pipeline.cache (the KV cache it writes). Never config, runtime, scheduling or serve.
"""
