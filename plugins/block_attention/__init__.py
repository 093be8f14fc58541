"""``dspark::BlockAttention``: a block of queries over a fixed-capacity KV cache.

``reference.py`` defines the semantics; ``torch_op.py`` wraps it as ``torch.ops.dspark.
block_attention`` (what the model code calls); ``onnx_function.py`` is its ONNX form.
"""
from .torch_op import block_attention

__all__ = ["block_attention"]
