"""PyTorch reference of ``dspark::BlockAttention``.

A block of ``S`` new rows per sequence is written into the fixed-capacity cache at that sequence's
own ``start`` index (its count of valid rows), then the block's queries attend over the cache:

- causal (target): query ``i`` sees cache rows ``< start + i + 1``;
- non-causal (DSpark draft): every query sees cache rows ``< start + S`` (the whole block).

Cache row index == absolute token position, so RoPE positions are ``start + i`` too. Rows past a
sequence's valid length are scratch: later blocks overwrite them before anything reads them.
The caller guarantees ``start + S <= capacity``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def block_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor,
                    causal: bool, scale: float):
    """``q [B, H, S, D]``, ``k_new/v_new [B, Hkv, S, D]``, caches ``[B, Hkv, C, D]``, ``start [B]``.

    Returns the attention output ``[B, H, S, D]`` and the updated caches.
    """
    batch, kv_heads, capacity, head_dim = k_cache.shape
    rows = q.shape[2]
    write = start[:, None] + torch.arange(rows, device=start.device)            # [B, S]
    index = write[:, None, :, None].expand(batch, kv_heads, rows, head_dim)
    k_cache = k_cache.scatter(2, index, k_new)
    v_cache = v_cache.scatter(2, index, v_new)

    limit = write + 1 if causal else (start + rows)[:, None].expand(batch, rows)
    visible = torch.arange(capacity, device=start.device) < limit[..., None]    # [B, S, C]
    out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=visible[:, None],
                                         scale=scale, enable_gqa=True)
    return out, k_cache, v_cache
