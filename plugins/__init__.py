"""Custom operators of the exported graphs, one folder each: ``block_attention`` and ``d2t_gather``.

Each folder holds the PyTorch reference that defines the operator's semantics; the ONNX schema,
TensorRT plugin and GPU kernel are checked against it.
"""
