"""The ids a reduced draft vocabulary (``--draft-vocab``) keeps."""
from __future__ import annotations

import torch


def draft_vocabulary(texts: list[list[int]], size: int, mask: int, vocab: int) -> torch.Tensor:
    """The ``size`` target ids a reduced draft keeps, ascending: the mask token and the most
    frequent ids in the training text, prompts (which answers copy from) and answers (ties: lower
    id first)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for ids in texts:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab)
    counts[mask] = -1
    order = torch.sort(-counts, stable=True).indices
    return torch.cat([order[:size - 1], torch.tensor([mask])]).sort().values
