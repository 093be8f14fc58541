"""PyTorch reference of ``dspark::CacheWrite``.

A block of ``S`` new K or V rows per sequence goes into the fixed-capacity cache at that sequence's
own ``start`` row, ``cache[b, :, start[b] + i] = new[b, :, i]``; every other row is kept. It is the
write half of ``dspark::BlockAttention``, for rows that are cached without being attended (the
draft's context rows). The caller guarantees ``start + S <= capacity``.
"""
from __future__ import annotations

import torch


def cache_write(cache: torch.Tensor, new: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """``cache [B, Hkv, C, D]``, ``new [B, Hkv, S, D]``, ``start [B]`` -> the updated cache."""
    batch, kv_heads, rows, head_dim = new.shape
    write = start[:, None] + torch.arange(rows, device=start.device)             # [B, S]
    return cache.scatter(2, write[:, None, :, None].expand(batch, kv_heads, rows, head_dim), new)
