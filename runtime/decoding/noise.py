"""A sampled request's randomness, keyed by position: one Gumbel vector over the target's ids per
generated token, a function of the seed and the token's index alone.

A token is ``argmax(log p + g)`` (Gumbel-max: a sample of ``p``), with ``g`` the vector of its
index, and the draft proposes it with the same vector (``argmax(log q + g)``). Verification keeps
a draft when it equals the target's token, so the output is the target's own sample for that seed
token for token, whatever was drafted, verified, batched or capped, as greedy output is the
target's argmax. A draft agrees with the target with probability at least ``(1 - d) / (1 + d)``
at total-variation distance ``d`` (Daliri et al., 2024, "Coupling without communication and
drafter-invariant speculative decoding"), against ``1 - d`` for rejection sampling, which draws
differently whenever the verification plan does.
"""
from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1


class Noise:
    """The Gumbel vectors ``[vocab]`` of one seed, made on ``device`` as an index is first asked
    for and kept until ``forget`` passes it (a step asks for the indices from its anchor's on, and
    rejected drafts' come back at the next step)."""

    def __init__(self, seed: int, vocab: int, device: torch.device | str = "cpu"):
        self.seed, self.vocab, self.device = seed, vocab, torch.device(device)
        self._rows: dict[int, torch.Tensor] = {}

    def rows(self, first: int, count: int) -> torch.Tensor:
        """``[count, vocab]``: the vectors of generated tokens ``first .. first + count - 1``."""
        return torch.stack([self._row(index) for index in range(first, first + count)])

    def forget(self, below: int) -> None:
        """Let go of the vectors of tokens before ``below`` (emitted: never asked for again)."""
        for index in [i for i in self._rows if i < below]:
            del self._rows[index]

    def _row(self, index: int) -> torch.Tensor:
        row = self._rows.get(index)
        if row is None:
            generator = torch.Generator(self.device).manual_seed(_mix(self.seed, index))
            # -log(-log(U)) in place; U in [2^-24, 1): U = 0 (once in 2^24 draws) would be -inf
            uniform = torch.rand(self.vocab, generator=generator, device=self.device)
            row = self._rows[index] = uniform.clamp_(min=2.0 ** -24).log_().neg_().log_().neg_()
        return row


def _mix(seed: int, index: int) -> int:
    """A 64-bit generator seed for ``(seed, index)``: splitmix64's finalizer over both, so that
    nearby seeds and indices start unrelated streams."""
    z = ((seed & MASK64) * 0x9E3779B97F4A7C15 + index + 1) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)
