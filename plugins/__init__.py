"""Custom operators of the exported graphs, one folder each: ``block_attention``, ``cache_write`` (the
draft's context rows, written in place), ``d2t_gather``, ``gated_delta`` (the linear-attention
recurrence of hybrid targets) and ``moe`` (a MoE layer's selected experts).

Each folder holds the PyTorch reference that defines the operator's semantics; the ONNX schema,
TensorRT plugin and GPU kernel are checked against it.
"""
