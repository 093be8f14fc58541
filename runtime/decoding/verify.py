"""Verification: how many of the ``k`` drafts the target accepts, and the token it emits after them.

Row ``j`` of the target's verify logits predicts the token after ``[anchor, d_1 .. d_j]``. The
target's token at each row is its argmax: of the logits when greedy, of its Gumbel scores
(``sampling.scores``, the noise of that row's position, ``noise.py``) when sampled. A draft is
accepted while it equals the target's token, so the emitted tokens are the target's own, whatever
was drafted. ``accept`` returns ``accepted [B]`` (``a`` in ``0..k``) and the target's tokens
``[B, k + 1]``, whose first ``a + 1`` are the accepted drafts followed by the correction (or, when
``a == k``, bonus) token.
"""
from __future__ import annotations

import torch

from runtime.decoding.sampling import argmax


def accept(drafts: torch.Tensor, scores: torch.Tensor, limit: torch.Tensor | None = None):
    """Accept the longest prefix of drafts equal to the argmax of ``scores [B, w + 1, V]`` (of at
    most ``limit [B]`` drafts: those after it count as never proposed)."""
    target = argmax(scores)                                                # [B, k+1]
    matches = (drafts == target[:, :-1]).long()
    accepted = matches.cumprod(dim=1).sum(dim=1)
    return (accepted if limit is None else torch.minimum(accepted, limit)), target
