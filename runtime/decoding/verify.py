"""Verification: how many of the ``k`` drafts the target accepts, and the token it emits after them.

Row ``j`` of the target's verify logits predicts the token after ``[anchor, d_1 .. d_j]``. Every
rule returns ``accepted [B]`` (``a`` in ``0..k``) and ``emitted [B, k + 1]`` whose first ``a + 1``
entries are the accepted drafts followed by the correction (or, when ``a == k``, bonus) token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.decoding.sampling import argmax, pick


def greedy_verify(drafts: torch.Tensor, logits: torch.Tensor, limit: torch.Tensor | None = None):
    """Accept the longest prefix of drafts equal to the target's argmax (of at most ``limit [B]``
    drafts: those after it count as never proposed)."""
    target = argmax(logits)                                                # [B, k+1]
    matches = (drafts == target[:, :-1]).long()
    accepted = matches.cumprod(dim=1).sum(dim=1)
    return (accepted if limit is None else torch.minimum(accepted, limit)), target


def rejection_verify(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, uniform: torch.Tensor,
                     limit: torch.Tensor | None = None):
    """Standard speculative sampling (Leviathan et al.; Chen et al.): accept draft ``d`` at row
    ``j`` with probability ``min(1, p_j[d] / q_j[d])``; at the first rejection draw from
    ``normalize(max(p_j - q_j, 0))``; if all drafts are accepted draw the bonus from ``p`` after
    them. The output is distributed exactly as the target's ``p`` whatever ``q`` is, provided each
    draft was drawn from its ``q``.

    ``drafts [B, w]``, ``q [B, w, V]``, ``p [B, w + 1, V]`` (target probabilities after its own
    temperature / top-p). ``uniform [B, >= w + 1]`` are each sequence's own U(0, 1) draws: the
    first ``w`` test the drafts, the last draws the token after them, so a sequence that draws
    ``k + 1`` per step from its own generator draws the same numbers whatever ``w`` its batch
    verifies. With ``limit [B]``, sequence ``b`` proposed only its first ``limit[b]`` drafts: it
    accepts at most those, and after all of them draws the bonus from ``p``.
    """
    batch, width = drafts.shape
    p_draft = p[:, :width].gather(-1, drafts[..., None])[..., 0]
    q_draft = q.gather(-1, drafts[..., None])[..., 0]
    ok = (uniform[:, :width] * q_draft < p_draft).long()
    accepted = ok.cumprod(dim=1).sum(dim=1)
    if limit is not None:
        accepted = torch.minimum(accepted, limit)

    rows = torch.arange(batch, device=drafts.device)
    residual = torch.cat([(p[:, :width] - q).clamp_min(0), p[:, width:]], dim=1)[rows, accepted]
    if limit is not None:    # no draft was proposed at row ``limit``: the bonus comes from p
        residual = torch.where((accepted < limit)[:, None], residual, p[rows, accepted])
    mass = residual.sum(-1, keepdim=True)
    # p == q exactly leaves no residual, and then rejection is impossible: fall back to p
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[rows, accepted])
    emitted = F.pad(drafts, (0, 1))                # its slot ``accepted`` is filled below
    emitted[rows, accepted] = pick(residual, uniform[:, -1])
    return accepted, emitted
