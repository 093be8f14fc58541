"""``dspark::GatedDeltaRule``: the gated delta rule of Qwen3.5's linear-attention layers, a
recurrence over a per-head state ``[key_dim, value_dim]``, with the states a speculative step needs.

A verify step runs ``k + 1`` rows through the recurrence but keeps only the state after its
accepted rows, which is known after the step. So a sequence's state lives in a bank of slots; the
op starts from the slot the caller names and writes into slots ``0 .. R-1`` the states after the
rows the caller asks for (``state_rows``): after every row in a verify step (the next step starts
from the slot of its accepted count), after the prompt's last real row in a prefill chunk (``-1``:
the state before the chunk, for a prompt that ended in an earlier chunk). No row is recomputed and
no state is copied per row (``docs/engine-contract.md``, "Recurrent state").

``reference.py`` defines the semantics; ``torch_op.py`` wraps it as ``torch.ops.dspark.
gated_delta_rule``; ``onnx_function.py`` is its ONNX form (a ``Scan`` over the rows);
``triton_kernel.py`` runs it in place on the GPU, for ``trt_plugin.py``.
"""
from .torch_op import gated_delta_rule

__all__ = ["gated_delta_rule"]
