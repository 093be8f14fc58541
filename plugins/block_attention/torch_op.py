"""``torch.ops.dspark.block_attention``: the reference as an opaque custom op, so that
``torch.export`` keeps it as one node for the ONNX exporter to translate."""
from __future__ import annotations

import torch

from .reference import block_attention as reference


@torch.library.custom_op("dspark::block_attention", mutates_args=())
def block_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, start: torch.Tensor, causal: bool, scale: float,
                    window: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference(q, k_new, v_new, k_cache, v_cache, start, causal, scale, window)


@block_attention.register_fake
def _(q, k_new, v_new, k_cache, v_cache, start, causal, scale, window=0):
    return torch.empty_like(q), torch.empty_like(k_cache), torch.empty_like(v_cache)
