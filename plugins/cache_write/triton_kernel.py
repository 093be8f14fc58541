"""GPU kernel that writes a block of K or V rows into a fixed-capacity cache in place, at each
sequence's own start row. Launches on the caller's stream; no allocation, no host sync."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _write_rows(new_ptr, cache_ptr, start_ptr, kv_heads, rows, capacity,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b * kv_heads + h, i): ``cache[b, h, (start[b] + i) mod C, :] = new[b, h, i, :]``
    (the modulo: a sliding layer's ring, ``block_attention/reference.py``)."""
    bh, i = tl.program_id(0), tl.program_id(1)
    b = bh // kv_heads
    d = tl.arange(0, BLOCK_D)
    row = tl.load(new_ptr + (bh * rows + i) * HEAD_DIM + d, mask=d < HEAD_DIM)
    position = (tl.load(start_ptr + b) + i) % capacity
    tl.store(cache_ptr + (bh * capacity + position) * HEAD_DIM + d, row, mask=d < HEAD_DIM)


def write_rows(new, cache, start) -> None:
    """``cache [B, Hkv, C, D][b, :, start[b] + i] = new [B, Hkv, S, D][b, :, i]``; contiguous
    tensors on one device, ``start + S <= C``."""
    batch, kv_heads, rows, head_dim = new.shape
    _write_rows[(batch * kv_heads, rows)](new, cache, start, kv_heads, rows, cache.shape[2],
                                          HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim))
