"""GPU kernel of ``dspark::D2TGather`` in Triton: a blocked argmax over the draft vocabulary (ties
go to the lowest id, as ``torch.argmax``), the ``d2t`` offset, and the Markov row gather. Launches
on the caller's stream; no allocation, no host sync. Semantics: ``reference.py``."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _d2t_gather(scores_ptr, d2t_ptr, w1_ptr, ids_ptr, rows_ptr, vocab, rank,
                BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program b: one sequence's choice."""
    b = tl.program_id(0)
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int64)
    for first in range(0, vocab, BLOCK_V):
        v = first + tl.arange(0, BLOCK_V)
        s = tl.load(scores_ptr + b * vocab + v, mask=v < vocab, other=float("-inf")).to(tl.float32)
        block_best = tl.max(s, axis=0)
        # lowest id among this block's maxima; a later block wins only if strictly larger
        block_id = tl.min(tl.where(s == block_best, v, vocab), axis=0).to(tl.int64)
        better = block_best > best
        best_id = tl.where(better, block_id, best_id)
        best = tl.where(better, block_best, best)
    target = best_id + tl.load(d2t_ptr + best_id)
    tl.store(ids_ptr + b, target)
    r = tl.arange(0, BLOCK_R)
    row = tl.load(w1_ptr + target * rank + r, mask=r < rank)
    tl.store(rows_ptr + b * rank + r, row, mask=r < rank)


def d2t_gather(scores, d2t, markov_w1, ids, rows, block_v: int = 1024):
    """Fill ``ids [B]`` (int64) and ``rows [B, r]`` from ``scores [B, V_d]``; contiguous tensors."""
    batch, vocab = scores.shape
    rank = markov_w1.shape[1]
    _d2t_gather[(batch,)](scores, d2t, markov_w1, ids, rows, vocab, rank,
                          BLOCK_V=min(block_v, triton.next_power_of_2(vocab)),
                          BLOCK_R=triton.next_power_of_2(rank))
