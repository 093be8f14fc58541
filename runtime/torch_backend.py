"""The PyTorch reference backend: runs ``TargetStep`` / ``DraftStep`` eagerly and owns their caches.

Every backend offers the same four things (``start``, ``target_step``, ``draft_step`` and a few
shape facts), so the loop in ``speculative.py`` never knows which one it drives.
"""
from __future__ import annotations

import torch

from export.draft_model import DraftStep
from export.target_model import TargetStep


class TorchBackend:
    def __init__(self, target: TargetStep, draft: DraftStep | None, capacity: int):
        self.target, self.draft, self.capacity = target, draft, capacity
        self.max_prompt_chunk = capacity
        self.vocab_size = target.config.vocab_size
        self.k = draft.k if draft is not None else 0
        self.draft_vocab_size = draft.config.draft_vocab_size if draft is not None else 0
        # the draft block writes scratch K/V up to block_size rows past the anchor
        self.lookahead = max(self.k + 1, draft.config.block_size if draft is not None else 1)

    def start(self, batch: int) -> None:
        """Fresh, empty caches for ``batch`` sequences."""
        self.target_cache = self.target.empty_cache(batch, self.capacity)
        if self.draft is not None:
            self.draft_cache = self.draft.empty_cache(batch, self.capacity)

    @torch.no_grad()
    def target_step(self, input_ids: torch.Tensor, start: torch.Tensor):
        logits, aux, *self.target_cache = self.target(input_ids, start, *self.target_cache)
        return logits, aux

    @torch.no_grad()
    def draft_step(self, ctx_aux, ctx_start, ctx_count, anchor, temperature, noise):
        tokens, q, *self.draft_cache = self.draft(ctx_aux, ctx_start, ctx_count, anchor,
                                                  temperature, noise, *self.draft_cache)
        return tokens, q
