"""Kernels: native C loops (compiled once per machine), int8 and oneDNN-packed linear layers,
batch-invariant matmuls, attention in the forms PyTorch's fast kernels accept, prefill without padding
and the head's float32 matmul.

May import torch and the standard library only (and pipeline.loading.default_model for its cache root).
"""
