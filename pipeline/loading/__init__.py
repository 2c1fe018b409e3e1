"""Getting a model into a stage: which model (hub: a folder or a hub id, cache first), the default model's files, tensors read on demand from safetensors
(tensor_store), this stage's weights (stage_weights), the upload into parameters, tokenizers and
LoRA adapter folders.

May import pipeline.models. Never the runtime, scheduling or serve.
"""
