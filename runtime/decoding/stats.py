"""Speculation statistics (tau and per-position acceptance) and the wall time of each phase."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class SpecStats:
    k: int
    steps: int = 0                     # verify steps, summed over sequences
    accepted_tokens: int = 0           # accepted drafts, summed
    accepted_at: list[int] = field(default_factory=list)   # [i]: steps that accepted draft i+1
    # [i]: verify steps whose cap reached draft i+1 with drafts 1..i accepted (``acceptance.py``)
    reached_at: list[int] = field(default_factory=list)
    # [i]: verify steps that verified draft i+1; those whose cap reached it with 1..i verified
    verified_at: list[int] = field(default_factory=list)
    offered_at: list[int] = field(default_factory=list)
    verified: int = 0                  # drafts verified (below the cap and the confidence cut), summed
    idle_steps: int = 0                # steps of a speculative sequence that verified no draft (cap 0)

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.k
        self.reached_at = self.reached_at or [0] * self.k
        self.verified_at = self.verified_at or [0] * self.k
        self.offered_at = self.offered_at or [0] * self.k

    def record(self, accepted: int, verified: int = 0, cap: int = 0) -> None:
        """A verify step (or a target-only sequence's step) that verified ``verified`` drafts of a
        cap of ``cap`` and accepted ``accepted``."""
        self.steps += 1
        self.accepted_tokens += accepted
        self.verified += verified
        for i in range(accepted):
            self.accepted_at[i] += 1
        for i in range(min(cap, accepted + 1, self.k)):
            self.reached_at[i] += 1
        for i in range(min(verified, self.k)):
            self.verified_at[i] += 1
        for i in range(min(cap, verified + 1, self.k)):
            self.offered_at[i] += 1

    @property
    def tau(self) -> float | None:
        """Mean tokens per verify step, the correction / bonus token counted (1.0 .. k + 1); None
        with no verify step (a mean of nothing, not 0)."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else None

    @property
    def acceptance_per_position(self) -> list[float]:
        """Fraction of verify steps whose draft ``i + 1`` was accepted."""
        return [n / self.steps if self.steps else 0.0 for n in self.accepted_at]

    @property
    def acceptance_rates(self) -> list[float]:
        """Per position, how often draft ``i + 1`` was accepted where the cap reached it after
        ``i`` accepted drafts (a draft the confidence cut left out counts as not accepted)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached_at)]

    @property
    def confidence_rates(self) -> list[float]:
        """Per position, how often the confidence cut let draft ``i + 1`` through where the cap
        reached it after ``i`` drafts it let through."""
        return [v / o if o else 0.0 for v, o in zip(self.verified_at, self.offered_at)]

    @property
    def verified_per_step(self) -> float:
        """Drafts verified per decode step, the steps that verified none counted."""
        steps = self.steps + self.idle_steps
        return self.verified / steps if steps else 0.0

    def merge(self, other: "SpecStats") -> None:
        """Add another batch's counts (same ``k``)."""
        self.steps += other.steps
        self.accepted_tokens += other.accepted_tokens
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at)]
        self.reached_at = [a + b for a, b in zip(self.reached_at, other.reached_at)]
        self.verified_at = [a + b for a, b in zip(self.verified_at, other.verified_at)]
        self.offered_at = [a + b for a, b in zip(self.offered_at, other.offered_at)]
        self.verified += other.verified
        self.idle_steps += other.idle_steps


@dataclass
class PhaseTimes:
    """Wall time per phase, seconds. ``host`` is everything outside the backend calls."""
    prefill: float = 0.0
    draft: float = 0.0
    verify: float = 0.0
    total: float = 0.0

    @property
    def host(self) -> float:
        return max(0.0, self.total - self.prefill - self.draft - self.verify)

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        """Add the wall time of the ``with`` body to ``phase``."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, phase, getattr(self, phase) + time.perf_counter() - begin)
