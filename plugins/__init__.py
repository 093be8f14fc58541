"""Custom operators of the exported graphs, one folder each: ``block_attention``, ``cache_write`` (the
draft's context rows, written in place), ``d2t_gather``, ``gated_delta`` (the linear-attention
recurrence of hybrid targets) and ``moe`` (a MoE layer's selected experts); ``qmatmul``, the CPU
kernel of the quantized and float products, which a loaded graph's linear layers become; ``cpu``,
the library of the compiled CPU kernels, built on the machine that runs it.

Each folder holds the PyTorch reference that defines the operator's semantics; the ONNX schema,
TensorRT plugin and GPU kernel are checked against it.
"""
