"""PyTorch reference of ``dspark::BlockAttention``.

A block of ``S`` new rows per sequence is written into the fixed-capacity cache at that sequence's
own ``start`` index (its count of valid rows), then the block's queries attend over the cache:

- causal (target): query ``i`` sees positions ``<= start + i``;
- non-causal (DSpark draft): every query sees positions ``< start + S`` (the whole block);
- sliding window ``W > 0`` (causal only; Gemma's sliding layers): query ``i`` also sees only
  positions ``> start + i - W``, its own window, so each row of a verify block has its own.

Position ``p`` lives in cache row ``p mod C``. Without a window ``start + S <= C`` and that is row
``p``, so RoPE positions and rows agree. A sliding layer's cache is a ring of ``C >= W + S_max - 1``
rows (``S_max``: the most rows a call writes): its window plus the rows a step may write past
it. That is what lets a block's writes and a verify step's rejected rows land in rows no query
still reads, so such a cache holds ``W + S_max - 1`` rows however long the sequence, not
``max_seq_len``. After a call's writes, row ``n`` holds the latest position ``<= end - 1`` (``end =
start + S``) congruent to it: ``end - 1 - ((end - 1 - n) mod C)``, negative where none is yet.
Rows past a sequence's valid length are scratch: later blocks overwrite them before anything reads
them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def held_positions(end: torch.Tensor, capacity: int) -> torch.Tensor:
    """``end [B]`` -> ``[B, C]``: the position each cache row holds once rows ``< end`` are written
    (negative: none)."""
    last = end[:, None] - 1
    return last - (last - torch.arange(capacity, device=end.device)) % capacity


def block_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor,
                    causal: bool, scale: float, window: int = 0):
    """``q [B, H, S, D]``, ``k_new/v_new [B, Hkv, S, D]``, caches ``[B, Hkv, C, D]``, ``start [B]``.

    Returns the attention output ``[B, H, S, D]`` and the updated caches.
    """
    if window and not causal:
        raise ValueError(f"window {window}: a sliding window is defined for causal attention only")
    batch, kv_heads, capacity, head_dim = k_cache.shape
    rows = q.shape[2]
    positions = start[:, None] + torch.arange(rows, device=start.device)           # [B, S]
    index = (positions % capacity)[:, None, :, None].expand(batch, kv_heads, rows, head_dim)
    k_cache = k_cache.scatter(2, index, k_new)
    v_cache = v_cache.scatter(2, index, v_new)

    held = held_positions(start + rows, capacity)[:, None, :]                        # [B, 1, C]
    newest = positions if causal else (start + rows - 1)[:, None].expand(batch, rows)
    visible = (held >= 0) & (held <= newest[..., None])                              # [B, S, C]
    if window:
        visible &= held > positions[..., None] - window
    out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=visible[:, None],
                                         scale=scale, enable_gqa=True)
    return out, k_cache, v_cache
