"""The repetition penalty, as ``transformers``' ``repetition_penalty`` and llama.cpp's
``--repeat-penalty`` over the whole context: the logit of every token already in a sequence
(prompt included) is divided by the penalty where positive, multiplied by it where negative.

A verify step's row ``j`` predicts the token after the drafts ``d_1 .. d_j``, so its history holds
them too: each row is penalized as target-only decoding would penalize it after those tokens,
which keeps greedy speculative output the target's (penalized) greedy output and sampling exact.
The drafts themselves come from the draft's own distribution, unpenalized, as rejection sampling
allows."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class RepetitionPenalty:
    """One sequence's penalty and the tokens it holds."""

    def __init__(self, penalty: float, prompt: list[int], vocab_size: int, device: torch.device):
        self.penalty = penalty
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.record(prompt)

    def record(self, tokens: list[int]) -> None:
        """Tokens that the sequence now holds."""
        if tokens:
            self.seen[torch.tensor(tokens, device=self.seen.device)] = True

    def __call__(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """``logits [R, V]`` penalized, row ``j`` also for ``drafts [>= R - 1]``'s first ``j``."""
        seen = self.seen.expand(logits.shape)
        if logits.shape[0] > 1:
            written = F.one_hot(drafts[: logits.shape[0] - 1], logits.shape[-1]).cumsum(0) > 0
            seen = seen | F.pad(written, (0, 0, 1, 0))
        penalized = torch.where(logits > 0, logits / self.penalty, logits * self.penalty)
        return torch.where(seen, penalized, logits)
