"""PyTorch reference of ``dspark::D2TGather``.

One step of the DSpark Markov sampler after the logits are formed: choose the draft-vocabulary id
(argmax of ``scores``, which already include any Gumbel noise), map it to the target vocabulary
with the ``d2t`` offsets (``target = id + d2t[id]``), and gather the Markov embedding row of that
*target* id, which conditions the next draft row.
"""
from __future__ import annotations

import torch


def d2t_gather(scores: torch.Tensor, d2t: torch.Tensor, markov_w1: torch.Tensor):
    """``scores [B, V_d]``, ``d2t [V_d]`` int64 offsets, ``markov_w1 [V, r]`` ->
    target ids ``[B]`` and their Markov rows ``[B, r]``."""
    draft_ids = scores.argmax(dim=-1)
    target_ids = draft_ids + d2t[draft_ids]
    return target_ids, markov_w1[target_ids]
