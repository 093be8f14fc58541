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

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.k

    def record(self, accepted: int) -> None:
        self.steps += 1
        self.accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_at[i] += 1

    @property
    def tau(self) -> float:
        """Mean tokens per verify step, the correction / bonus token counted (1.0 .. k + 1)."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Fraction of verify steps whose draft ``i + 1`` was accepted."""
        return [n / self.steps if self.steps else 0.0 for n in self.accepted_at]

    def merge(self, other: "SpecStats") -> None:
        """Add another batch's counts (same ``k``)."""
        self.steps += other.steps
        self.accepted_tokens += other.accepted_tokens
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at)]


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
