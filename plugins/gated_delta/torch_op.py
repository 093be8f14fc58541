"""``torch.ops.dspark.gated_delta_rule``: the reference as an opaque custom op, so that
``torch.export`` keeps it as one node for the ONNX exporter to translate."""
from __future__ import annotations

import torch

from .reference import gated_delta_rule as reference


@torch.library.custom_op("dspark::gated_delta_rule", mutates_args=())
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, slot: torch.Tensor,
                     state_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return reference(q, k, v, g, beta, state, slot, state_rows)


@gated_delta_rule.register_fake
def _(q, k, v, g, beta, state, slot, state_rows):
    return torch.empty_like(v), torch.empty_like(state)
