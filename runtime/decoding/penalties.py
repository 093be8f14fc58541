"""The penalties on tokens a sequence already holds, as vLLM and llama-server apply them:

- ``repetition_penalty`` (``transformers``', llama.cpp's ``--repeat-penalty``) over the whole
  context, prompt included: the logit of every token in it is divided by the penalty where
  positive, multiplied by it where negative;
- ``frequency_penalty`` and ``presence_penalty`` (OpenAI's) over the generated tokens: a token's
  logit less ``frequency_penalty`` times its count so far, and less ``presence_penalty`` once it
  has appeared.

A verify step's row ``j`` predicts the token after the drafts ``d_1 .. d_j``, so its history holds
them too: each row is penalized as target-only decoding would penalize it after those tokens,
which keeps greedy speculative output the target's (penalized) greedy output and sampling exact.
The drafts themselves come from the draft's own distribution, unpenalized: what a step emits is
the target's (penalized) token at each row, whatever was drafted."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Penalties:
    """One sequence's penalties and the tokens it holds."""

    def __init__(self, repetition: float, presence: float, frequency: float, prompt: list[int],
                 vocab_size: int, device: torch.device):
        self.repetition, self.presence, self.frequency = repetition, presence, frequency
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)     # prompt and output
        self.counts = torch.zeros(vocab_size, device=device)                     # output only
        if prompt:
            self.seen[torch.tensor(prompt, device=device)] = True

    def record(self, tokens: list[int]) -> None:
        """Tokens the sequence generated."""
        if tokens:
            ids = torch.tensor(tokens, device=self.seen.device)
            self.seen[ids] = True
            self.counts.index_add_(0, ids, torch.ones(len(tokens), device=self.counts.device))

    def __call__(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """``logits [R, V]`` penalized, row ``j`` also for ``drafts [>= R - 1]``'s first ``j``."""
        counts = self.counts.expand(logits.shape)
        if logits.shape[0] > 1:
            written = F.one_hot(drafts[: logits.shape[0] - 1], logits.shape[-1]).cumsum(0)
            counts = counts + F.pad(written, (0, 0, 1, 0))
        if self.repetition != 1:
            penalized = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = torch.where(self.seen | (counts > 0), penalized, logits)
        if self.frequency or self.presence:
            logits = logits - self.frequency * counts - self.presence * (counts > 0).to(logits.dtype)
        return logits
