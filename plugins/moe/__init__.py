"""``dspark::MoeExperts``: the routed experts of a mixture-of-experts layer (Qwen3-MoE, Qwen3.5-MoE,
Gemma 4 MoE), computing only the experts that some token selected. Attribute ``activation``: the
gate's activation, an index into ``ACTIVATIONS`` (SiLU for Qwen's SwiGLU, tanh-approximated GELU
for Gemma's GeGLU).

``reference.py`` defines the semantics; ``torch_op.py`` wraps it as ``torch.ops.dspark.moe_experts``;
``onnx_function.py`` is its ONNX form: a ``Loop`` over the selected experts (``Unique`` of the
routing), each gathering its tokens, its two weight matrices and scattering its weighted output
back, so a verify step of 9 tokens at top-8 of 128 experts reads at most 72 experts' weights, not
128, and a decode step 8.
"""
# the ONNX op type (``dspark::MoeExperts``) and its two expert matrices, here so that ONNX
# Runtime's lowering of it (``ort_cpu.py``, every engine load) finds them without importing onnxscript
NAME = "MoeExperts"
MATRICES = ("gate_up", "down")
ACTIVATIONS = ("silu", "gelu_tanh")

from .torch_op import moe_experts  # noqa: E402

__all__ = ["moe_experts"]
