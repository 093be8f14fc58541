"""PyTorch reference of ``dspark::MoeExperts``.

For each token ``t`` and each of its ``k`` selected experts ``e = experts[t, j]`` with weight
``weights[t, j]``: ``gate, up = split(gate_up[e] @ x_t)``, ``y = down[e] @ (act(gate) * up)``, and
``out_t = sum_j weights[t, j] * y``, the experts added in ascending order of their index, as
``transformers``' ``Qwen3MoeExperts`` adds them. Experts no token selected are never touched.
``act`` is ``ACTIVATIONS[activation]``: SiLU, or GELU with the tanh approximation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, activation: int = 0) -> torch.Tensor:
    """``x [T, H]``, ``experts [T, k]`` (int64 expert ids), ``weights [T, k]`` (``x``'s dtype),
    ``gate_up [E, 2I, H]``, ``down [E, H, I]`` -> ``[T, H]``."""
    out = torch.zeros_like(x)
    for expert in torch.unique(experts).tolist():
        slot, token = torch.where(experts.T == expert)   # by slot, then token: transformers' order
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        act = F.silu(gate) if activation == 0 else F.gelu(gate, approximate="tanh")
        y = F.linear(act * up, down[expert]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
