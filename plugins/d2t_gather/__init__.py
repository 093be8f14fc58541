"""``dspark::D2TGather``: pick a draft id, map it to a target id, fetch its Markov row.

``reference.py`` defines the semantics; ``torch_op.py`` wraps it as ``torch.ops.dspark.
d2t_gather`` (what the model code calls); ``onnx_function.py`` is its ONNX form.
"""
# the ONNX op type, here so that the CPU lowering (``block_attention/ort_cpu.py``, every engine
# load) finds it without importing onnxscript
NAME = "D2TGather"

from .torch_op import d2t_gather  # noqa: E402

__all__ = ["d2t_gather"]
