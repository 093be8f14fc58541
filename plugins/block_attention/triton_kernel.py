"""GPU kernels of ``dspark::BlockAttention`` in Triton: the in-place K/V write and the attention.

Both launch on the caller's stream, allocate nothing and never synchronise with the host, so a
TensorRT plugin can run them inside a captured CUDA graph. Accumulation is fp32 whatever the
input dtype. Semantics: ``reference.py``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..cache_write.triton_kernel import write_rows


@triton.jit
def _attend(q_ptr, k_ptr, v_ptr, out_ptr, start_ptr, heads, kv_heads, rows, capacity, scale,
            CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """Program (b * heads + h, i): query row ``i`` of head ``h`` over the visible cache rows,
    with an online softmax (running max and sum) in fp32."""
    bh, i = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    kv = b * kv_heads + h // (heads // kv_heads)
    start = tl.load(start_ptr + b)
    limit = start + i + 1 if CAUSAL else start + rows
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + (bh * rows + i) * HEAD_DIM + d, mask=d < HEAD_DIM).to(tl.float32) * scale
    best = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for first in range(0, limit, BLOCK_N):
        n = first + tl.arange(0, BLOCK_N)
        visible = n < limit
        offsets = (kv * capacity + n[:, None]) * HEAD_DIM + d[None, :]
        io_mask = visible[:, None] & (d[None, :] < HEAD_DIM)
        keys = tl.load(k_ptr + offsets, mask=io_mask, other=0.0).to(tl.float32)
        scores = tl.where(visible, tl.sum(keys * q[None, :], axis=1), float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=0))
        weights = tl.exp(scores - new_best)
        correction = tl.exp(best - new_best)
        values = tl.load(v_ptr + offsets, mask=io_mask, other=0.0).to(tl.float32)
        acc = acc * correction + tl.sum(weights[:, None] * values, axis=0)
        total = total * correction + tl.sum(weights, axis=0)
        best = new_best
    out = acc / total
    tl.store(out_ptr + (bh * rows + i) * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def block_attention(q, k_new, v_new, k_cache, v_cache, start, out, causal: bool, scale: float,
                    block_n: int = 32):
    """Write ``k_new``/``v_new`` into the caches in place at each row's ``start``, then fill
    ``out``. Shapes as in ``reference.py``; every tensor contiguous, on one device."""
    batch, heads, rows, head_dim = q.shape
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    block_d = triton.next_power_of_2(head_dim)
    write_rows(k_new, k_cache, start)
    write_rows(v_new, v_cache, start)
    _attend[(batch * heads, rows)](q, k_cache, v_cache, out, start, heads, kv_heads, rows, capacity,
                                   scale, CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_D=block_d,
                                   BLOCK_N=block_n)
