"""GPU kernels of ``dspark::BlockAttention`` in Triton: the in-place K/V write, then the attention.

The attention is a flash-attention tile per (sequence, KV head, tile of query rows): the rows of
every query head that shares the KV head (the GQA group) are stacked, so one pass over the cache
serves the whole group, and scores and outputs are ``tl.dot`` products on tensor cores with an
online softmax in fp32. A decode or verify block has few rows, which leaves too few programs to
use the GPU, so the visible cache is also split across programs (flash-decoding) and a second
kernel merges the partial results by their log-sum-exp. The split count depends only on shapes,
so a captured CUDA graph replays the same launches.

Every launch goes on the caller's stream, allocates nothing (the partial results live in a
workspace the caller passes, TensorRT's in the plugin) and never synchronises with the host.
Semantics: ``reference.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..cache_write.triton_kernel import write_rows

TARGET_PROGRAMS = 264      # about two programs per SM on an H200 (132 SMs)
MAX_SPLITS = 32


@triton.jit
def _attend(q_ptr, k_ptr, v_ptr, out_ptr, o_part_ptr, lse_part_ptr, start_ptr,
            heads, kv_heads, rows, capacity, scale, window,
            CAUSAL: tl.constexpr, GROUP: tl.constexpr, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            PRECISION: tl.constexpr):
    """Program (b * kv_heads + h, tile, split): tile rows ``r`` are (query row ``r // GROUP``,
    head ``h * GROUP + r % GROUP``) pairs; the split takes its share of the cache rows the tile may
    see. Each cache row's position is ``reference.held_positions``'s (the row itself unless the
    cache is a ring that has wrapped), and a row is seen from its query's window."""
    bk, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kv_head = bk // kv_heads, bk % kv_heads
    group_rows = rows * GROUP
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    live = r < group_rows
    i = r // GROUP
    d = tl.arange(0, BLOCK_D)
    q_offsets = ((b * heads + kv_head * GROUP + r % GROUP) * rows + i)[:, None] * HEAD_DIM + d[None, :]
    q_mask = live[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)

    start = tl.load(start_ptr + b)
    last = start + rows - 1
    if CAUSAL:
        newest = start + i
        tile_limit = start + tl.minimum(tile * BLOCK_M + BLOCK_M - 1, group_rows - 1) // GROUP + 1
    else:
        newest = last + tl.zeros_like(i)
        tile_limit = last + 1
    lowest = tl.where(window > 0, start + i - window, -1)          # exclusive
    # rows below tile_limit hold positions below it, unless the ring has wrapped: then every row
    tile_limit = tl.where(last >= capacity, capacity, tile_limit)
    chunk = tl.cdiv(tl.cdiv(tile_limit, SPLITS), BLOCK_N) * BLOCK_N
    low = split * chunk
    high = tl.minimum(low + chunk, tile_limit)

    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for first in range(low, high, BLOCK_N):
        n = first + tl.arange(0, BLOCK_N)
        kv_offsets = (bk * capacity + n)[:, None] * HEAD_DIM + d[None, :]
        kv_mask = (n < high)[:, None] & (d[None, :] < HEAD_DIM)
        keys = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
        held = last - (last - n) % capacity                          # n <= last: no negative modulo
        visible = ((held[None, :] <= newest[:, None]) & (held[None, :] > lowest[:, None])
                   & (n < high)[None, :])
        scores = tl.where(visible, scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)   # rows that see nothing yet
        weights = tl.exp(scores - shift[:, None])
        correction = tl.exp(best - shift)
        values = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        acc = acc * correction[:, None] + tl.dot(weights.to(values.dtype), values,
                                                 input_precision=PRECISION)
        total = total * correction + tl.sum(weights, axis=1)
        best = new_best

    if SPLITS == 1:
        tl.store(out_ptr + q_offsets, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
    else:   # a split may see no row at all: weight zero in the merge
        part = (bk * group_rows + r) * SPLITS + split
        seen = total > 0.0
        total = tl.where(seen, total, 1.0)
        tl.store(o_part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc / total[:, None], mask=q_mask)
        tl.store(lse_part_ptr + part, tl.where(seen, best + tl.log(total), float("-inf")), mask=live)


@triton.jit
def _merge(o_part_ptr, lse_part_ptr, out_ptr, heads, kv_heads, rows,
           GROUP: tl.constexpr, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
           BLOCK_S: tl.constexpr):
    """Program (b * kv_heads + h, r): one output row from its splits' partials."""
    bk, r = tl.program_id(0), tl.program_id(1)
    b, kv_head = bk // kv_heads, bk % kv_heads
    s, d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    part = (bk * rows * GROUP + r) * SPLITS + s
    lse = tl.load(lse_part_ptr + part, mask=s < SPLITS, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, axis=0))
    partials = tl.load(o_part_ptr + part[:, None] * HEAD_DIM + d[None, :],
                       mask=(s < SPLITS)[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(weights[:, None] * partials, axis=0) / tl.sum(weights, axis=0)
    row = (b * heads + kv_head * GROUP + r % GROUP) * rows + r // GROUP
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@dataclass(frozen=True)
class Plan:
    """How one call is tiled: query rows per tile, tiles per KV head, cache splits."""
    block_m: int
    tiles: int
    splits: int

    def workspace_floats(self, batch: int, kv_heads: int, group_rows: int, head_dim: int) -> int:
        """fp32 partial outputs and log-sum-exps; none when the cache is not split."""
        return 0 if self.splits == 1 else batch * kv_heads * group_rows * self.splits * (head_dim + 1)


def plan(batch: int, heads: int, kv_heads: int, rows: int, programs: int = TARGET_PROGRAMS) -> Plan:
    """Split the cache only as far as needed to give the GPU about ``programs`` programs."""
    group_rows = rows * (heads // kv_heads)
    block_m = max(16, min(64, triton.next_power_of_2(group_rows)))
    tiles = triton.cdiv(group_rows, block_m)
    splits = max(1, min(MAX_SPLITS, programs // (batch * kv_heads * tiles)))
    return Plan(block_m, tiles, splits)


def workspace_bound(head_dim: int, programs: int = TARGET_PROGRAMS) -> int:
    """Bytes of workspace enough for any shape: splitting happens only while the tiles number
    fewer than ``programs``, so partial rows stay under ``64 * programs`` per split count."""
    return 64 * programs * (head_dim + 1) * 4


def block_attention(q, k_new, v_new, k_cache, v_cache, start, out, causal: bool, scale: float,
                    window: int = 0, workspace: torch.Tensor | None = None, splits: int | None = None,
                    block_n: int = 64):
    """Write ``k_new``/``v_new`` into the caches in place at each row's ``start``, then fill
    ``out``. Shapes as in ``reference.py``; every tensor contiguous, on one device. ``workspace``:
    a flat fp32 buffer of at least ``workspace_bound`` bytes (allocated here when not given);
    ``splits`` overrides the plan's split count (tests use it to cover both paths)."""
    batch, heads, rows, head_dim = q.shape
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    write_rows(k_new, k_cache, start)
    write_rows(v_new, v_cache, start)
    chosen = plan(batch, heads, kv_heads, rows)
    if splits is not None:
        chosen = Plan(chosen.block_m, chosen.tiles, splits)
    floats = chosen.workspace_floats(batch, kv_heads, rows * group, head_dim)
    if workspace is None:
        workspace = torch.empty(floats, dtype=torch.float32, device=q.device)
    lse_part = workspace[batch * kv_heads * rows * group * chosen.splits * head_dim:]
    block_d = max(16, triton.next_power_of_2(head_dim))
    _attend[(batch * kv_heads, chosen.tiles, chosen.splits)](
        q, k_cache, v_cache, out, workspace, lse_part, start, heads, kv_heads, rows, capacity, scale, window,
        CAUSAL=causal, GROUP=group, SPLITS=chosen.splits, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=chosen.block_m, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if chosen.splits > 1:
        _merge[(batch * kv_heads, rows * group)](
            workspace, lse_part, out, heads, kv_heads, rows, GROUP=group, SPLITS=chosen.splits,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(chosen.splits))
