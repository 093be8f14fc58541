"""GPU kernels of ``dspark::D2TGather`` in Triton: an argmax over the draft vocabulary (ties go to
the lowest id, as ``torch.argmax``), the ``d2t`` offset, and the Markov row gather.

One program per sequence would stream a 151936-entry row through a single SM, k times per draft
step, so the argmax is split: programs each reduce one block of the row and fold their winner
into a 64-bit key in the ``ids`` output with an atomic max (the score's order-preserving bits
above, ``2**31 - 1 - id`` below, so a tie keeps the lowest id). The order of the atomics
does not change the result. A last program per sequence decodes the key, applies ``d2t`` and
gathers the row. Launches on the caller's stream; no allocation, no host sync.
Semantics: ``reference.py``.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOWEST_KEY = -(1 << 63)


@triton.jit
def _block_argmax(scores_ptr, ids_ptr, vocab, BLOCK_V: tl.constexpr):
    """Program (b, block): fold this block's best score and lowest id of it into ``ids[b]``."""
    b, block = tl.program_id(0), tl.program_id(1)
    v = block * BLOCK_V + tl.arange(0, BLOCK_V)
    s = tl.load(scores_ptr + b * vocab + v, mask=v < vocab, other=float("-inf")).to(tl.float32)
    best = tl.max(s, axis=0) + 0.0                                       # -0.0 ties +0.0 as in torch
    best_id = tl.min(tl.where(s == best, v, vocab), axis=0)
    bits = best.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)   # float order as int order
    tl.atomic_max(ids_ptr + b, (ordered << 32) | (0x7FFFFFFF - best_id).to(tl.int64))


@triton.jit
def _finish(ids_ptr, d2t_ptr, w1_ptr, rows_ptr, rank, BLOCK_R: tl.constexpr):
    """Program b: the draft id from the key, its target id, and the target's Markov row."""
    b = tl.program_id(0)
    key = tl.load(ids_ptr + b)
    draft_id = 0x7FFFFFFF - (key & 0x7FFFFFFF)
    target = draft_id + tl.load(d2t_ptr + draft_id)
    tl.store(ids_ptr + b, target)
    r = tl.arange(0, BLOCK_R)
    row = tl.load(w1_ptr + target * rank + r, mask=r < rank)
    tl.store(rows_ptr + b * rank + r, row, mask=r < rank)


def d2t_gather(scores, d2t, markov_w1, ids, rows, block_v: int = 4096):
    """Fill ``ids [B]`` (int64) and ``rows [B, r]`` from ``scores [B, V_d]``; contiguous tensors."""
    batch, vocab = scores.shape
    rank = markov_w1.shape[1]
    block_v = min(block_v, triton.next_power_of_2(vocab))
    ids.fill_(LOWEST_KEY)
    _block_argmax[(batch, triton.cdiv(vocab, block_v))](scores, ids, vocab, BLOCK_V=block_v)
    _finish[(batch,)](ids, d2t, markov_w1, rows, rank, BLOCK_R=triton.next_power_of_2(rank))
