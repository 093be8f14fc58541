"""The draft's acceptance on held-out prompts: teacher-forced during training (cheap, every
``--eval-every`` steps, on each prompt file's held-out records: what stops the run and picks the
checkpoint), and by decoding once at the end, on the draft as saved."""
from __future__ import annotations

from pathlib import Path

import torch

from modeling.dense import TargetStep
from modeling.draft import DraftStep, load_draft
from runtime.backends.base import capacity_needed
from runtime.backends.pytorch import TorchBackend
from runtime.decoding.batch import generate

from .loss import teacher_forced_logits

ANCHORS_PER_CALL = 128         # blocks in one training forward, as a training step's


@torch.no_grad()
def teacher_forced_tau(draft: DraftStep, sequences: list[tuple[torch.Tensor, int, torch.Tensor]],
                       kept: torch.Tensor | None) -> float:
    """Greedy tokens per verify step had every generated position of ``sequences`` (``(tokens,
    prompt length, taps)``, the target's own greedy answers) been an anchor: 1 + the leading
    drafts that equal the target's next tokens. A row's Markov predecessor is the true token,
    which is the draft's own proposal wherever the drafts before it were accepted, so each
    anchor's count is what decoding from it would accept (with every draft verified)."""
    was_training = draft.training
    draft.eval()
    accepted, anchors_seen = 0, 0
    for tokens, prompt_length, taps in sequences:
        anchors = torch.arange(prompt_length, tokens.numel() - 1)
        for part in anchors.split(ANCHORS_PER_CALL):
            logits, labels = teacher_forced_logits(draft, taps.float(), tokens, part)
            proposals = logits.argmax(-1)
            proposals = kept[proposals] if kept is not None else proposals
            matches = (proposals == labels).long().cumprod(dim=1)   # leading matches only
            accepted += int(matches.sum())
            anchors_seen += part.numel()
    draft.train(was_training)
    return 1 + accepted / max(anchors_seen, 1)


def measure_tau(target: TargetStep, out: Path, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Greedy acceptance (tokens per verify step) of the draft as saved in ``out``, loaded the way
    every consumer loads it."""
    draft = load_draft(out, target)
    capacity = capacity_needed(max(map(len, prompts)), max_new_tokens, k=draft.k,
                               block_size=draft.config.block_size)
    result = generate(TorchBackend(target, draft, capacity), prompts, max_new_tokens=max_new_tokens,
                      eos_token_ids=target.config.eos_token_ids)
    return result.stats.tau
