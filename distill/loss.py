"""What the draft learns: every anchor's block at once (the model's own training forward,
``DraftStep.training_logits``), its labels, and the loss."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from modeling.draft import DraftStep


def teacher_forced_logits(draft: DraftStep, aux: torch.Tensor, tokens: torch.Tensor,
                          anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's training forward (``DraftStep.training_logits``) for ``anchors [n]`` of
    ``tokens [S]``, and what each row learns: ``logits [n, B, V_d]`` (draft space) and
    ``labels [n, B]``, the target id at ``p + j + 1``, or -100 past the end of the sequence."""
    span = anchors[:, None] + torch.arange(draft.config.block_size)
    following, length = span + 1, tokens.numel()
    labels = torch.where(following < length, tokens[following.clamp(max=length - 1)], -100)
    return draft.training_logits(aux, tokens, anchors), labels


def block_loss(logits: torch.Tensor, labels: torch.Tensor, to_draft: torch.Tensor | None,
               decay: float | None) -> torch.Tensor:
    """Cross-entropy over the block rows, averaged, row ``j`` weighted ``exp(-j / decay)`` when
    ``decay`` is set (early rows decide acceptance). With a reduced vocabulary the labels move to
    draft ids (``to_draft``); those outside the draft vocabulary cannot be drafted and are skipped."""
    if to_draft is not None:
        labels = torch.where(labels >= 0, to_draft[labels.clamp(min=0)], -100)
    count, block = labels.shape
    rows = torch.arange(block, dtype=torch.float32)
    weight = torch.exp(-rows / decay) if decay else torch.ones(block)
    weight = weight.expand(count, block) * (labels >= 0)
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                         reduction="none")
    return (ce * weight.flatten()).sum() / weight.sum().clamp(min=1e-6)
