"""``dspark::CacheWrite``: write a block of K or V rows into a fixed-capacity cache at each
sequence's start row.

``reference.py`` defines the semantics; ``torch_op.py`` wraps it as ``torch.ops.dspark.
cache_write`` (what the model code calls); ``onnx_function.py`` is its ONNX form; ``triton_kernel.py``
writes in place on the GPU, for this plugin and for ``dspark::BlockAttention``'s own write.
"""
# the ONNX op type, here so that the CPU lowering (``block_attention/ort_cpu.py``, every engine
# load) finds it without importing onnxscript
NAME = "CacheWrite"

from .torch_op import cache_write  # noqa: E402

__all__ = ["cache_write"]
