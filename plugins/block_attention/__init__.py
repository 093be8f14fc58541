"""``dspark::BlockAttention``: a block of queries over a fixed-capacity KV cache.

``reference.py`` defines the semantics; ``torch_op.py`` wraps it as ``torch.ops.dspark.
block_attention`` (what the model code calls); ``onnx_function.py`` is its ONNX form.
"""
# the ONNX op type (``dspark::BlockAttention``), here so that ONNX Runtime's lowering of it
# (``ort_contrib.py``, every engine load) finds it without importing onnxscript
NAME = "BlockAttention"

from .torch_op import block_attention  # noqa: E402

__all__ = ["block_attention"]
