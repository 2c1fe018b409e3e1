"""Moving tensors and control between processes: process-group set-up (gloo on CPU, NCCL plus a gloo
header group on GPUs), one-way point-to-point channels, fault injection for tests, and the lifeline
that ends a rank whose launcher or peer is gone.

May import torch and the standard library only; nothing from pipeline, tasks or serve.
"""
