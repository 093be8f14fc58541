"""``torch.ops.dspark.d2t_gather``: the reference as an opaque custom op for ``torch.export``."""
from __future__ import annotations

import torch

from .reference import d2t_gather as reference


@torch.library.custom_op("dspark::d2t_gather", mutates_args=())
def d2t_gather(scores: torch.Tensor, d2t: torch.Tensor,
               markov_w1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return reference(scores, d2t, markov_w1)


@d2t_gather.register_fake
def _(scores, d2t, markov_w1):
    batch = scores.shape[0]
    return scores.new_empty(batch, dtype=torch.long), markov_w1.new_empty(batch, markov_w1.shape[1])
