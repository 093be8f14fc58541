"""``torch.ops.dspark.moe_experts``: the reference as an opaque custom op, so that ``torch.export``
keeps it as one node (its loop over the selected experts is data-dependent) for the ONNX exporter
to translate. On CUDA tensors it runs the Triton kernel instead: the reference asks the host which
experts were chosen, which a CUDA graph cannot capture."""
from __future__ import annotations

import torch

from .reference import moe_experts as reference


@torch.library.custom_op("dspark::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, activation: int = 0) -> torch.Tensor:
    if not x.is_cuda:
        return reference(x, experts, weights, gate_up, down, activation)
    from .triton_kernel import moe_experts as kernel

    out = torch.empty_like(x)
    kernel(x.contiguous(), experts.contiguous(), weights.contiguous(), gate_up.contiguous(),
           down.contiguous(), out, activation=activation)
    return out


@moe_experts.register_fake
def _(x, experts, weights, gate_up, down, activation=0):
    return torch.empty_like(x)
