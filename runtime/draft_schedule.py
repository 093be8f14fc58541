"""How many drafts a step verifies as the batch fills (vLLM's and TensorRT-LLM's draft-length
schedule): ``1:4,3:2,6:0`` verifies at most 4 drafts per request while 1 or 2 of the pool's
slots are busy, 2 from 3 on, none (target-only steps) from 6 on.

A verify row is nearly free while the target is bound by reading its weights, and costs its full
compute once the batch's rows make it compute-bound; so the rows worth verifying shrink as slots
fill. ``measure`` times the backend's calls at every batch size on the machine it runs on, and
``choose`` keeps the engine's ``k`` (with the confidence threshold it was built with: the choice for
one sequence) while a verify row costs, relative to its step, what it costs for one sequence, and
cuts the cap in proportion as it gets dearer. (Planning with the draft's acceptance instead would
need acceptance like the traffic's: measured on any fixed prompts it is another domain's.) The
confidence cut still applies below the cap.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .backend import Backend


@dataclass(frozen=True)
class DraftSchedule:
    """``steps``: ``(busy, drafts)`` pairs, ``busy`` ascending from 1: from ``busy`` occupied
    slots on, at most ``drafts`` drafts per request per step."""
    steps: tuple[tuple[int, int], ...]

    @classmethod
    def constant(cls, drafts: int) -> "DraftSchedule":
        return cls(((1, drafts),))

    @classmethod
    def parse(cls, text: str, k: int, flag: str = "--draft-schedule") -> "DraftSchedule":
        """``"1:4,3:2,6:0"`` (or one number: that cap at every load), refused in one line."""
        expected = (f"expected BUSY:DRAFTS pairs with BUSY rising from 1 and DRAFTS 0 .. {k} "
                    f"(the engine's k), e.g. 1:{k},4:{k // 2},8:0, or one number")
        try:
            pairs = [(1, int(text))] if ":" not in text else [
                tuple(int(n) for n in part.split(":")) for part in text.split(",")]
        except ValueError:
            pairs = None
        if (not pairs or any(len(p) != 2 for p in pairs) or pairs[0][0] != 1
                or any(b <= a for (a, _), (b, _) in zip(pairs, pairs[1:]))
                or any(not 0 <= d <= k for _, d in pairs)):
            raise ValueError(f"{flag} {text!r}: {expected}")
        return cls(tuple(pairs))

    def drafts(self, busy: int) -> int:
        """The cap while ``busy`` slots are occupied."""
        return next(d for b, d in reversed(self.steps) if b <= busy)

    def __str__(self) -> str:
        return ",".join(f"{b}:{d}" for b, d in self.steps)


@dataclass(frozen=True)
class Costs:
    """Seconds per target call with ``b`` busy slots (index ``b - 1``), on one row and on
    ``k + 1`` rows per sequence: a call of ``b`` sequences, or of the whole pool on a pooled
    backend."""
    target_one: list[float]
    target_full: list[float]


def choose(costs: Costs, k: int) -> DraftSchedule:
    """``k`` drafts for one busy slot; for ``b``, ``k * m(1) / m(b)`` (rounded; ``k`` while within
    25%; never rising with ``b``), where ``m(b) = (t(b, k + 1) - t(b, 1)) / (k * t(b, 1))`` is what a
    verify row adds to a step of ``b`` sequences, relative to the step."""
    def row_cost(b: int) -> float:
        one = costs.target_one[b - 1]
        return max(costs.target_full[b - 1] - one, 0.0) / (k * one) if k else 0.0

    alone = max(row_cost(1), 1e-9)
    caps = []
    for batch in range(1, len(costs.target_one) + 1):
        dearer = row_cost(batch) / alone
        # a difference of two timings is noisy (10-20% on a shared machine): within that, no change
        cap = k if dearer <= 1.25 else round(k / dearer)
        caps.append(min([cap, *caps[-1:]]))
    steps = [(1, caps[0])] + [(b + 1, c) for b, c in enumerate(caps) if b and c != caps[b - 1]]
    return DraftSchedule(tuple(steps))


def measure(backend: Backend, repeats: int = 3) -> tuple[DraftSchedule, Costs]:
    """The schedule for this machine from each call's time (the fastest of ``repeats``, after one
    untimed call) at every batch size. The backend's caches hold junk afterwards: start or clear
    them."""
    limits = backend.limits
    backend.start(limits.max_batch)
    k, device = limits.k, backend.device
    position = min(256, limits.capacity - limits.lookahead - 1)

    def fastest(call) -> float:
        call()
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            call()
            times.append(time.perf_counter() - begin)
        return min(times)

    one, full = [], []
    # a pooled backend's step runs the whole pool whatever the load: one call to time
    sizes = [limits.max_batch] if backend.pooled else range(1, limits.max_batch + 1)
    with torch.inference_mode():
        for batch in sizes:
            at = {} if backend.pooled else {"slots": list(range(batch))}
            start = torch.full((batch,), position, device=device)

            def target(rows: int):
                ids = torch.zeros(batch, rows, dtype=torch.long, device=device)
                positions = torch.arange(rows, device=device).expand(batch, rows)
                return backend.target_step(ids, start, positions, torch.zeros_like(start), positions, **at)

            one.append(fastest(lambda: target(1)))
            full.append(fastest(lambda: target(k + 1)))
    if backend.pooled:
        one, full = one * limits.max_batch, full * limits.max_batch
    costs = Costs(one, full)
    return choose(costs, k), costs
