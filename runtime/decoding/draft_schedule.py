"""How many drafts a step verifies: a ``DraftSchedule``, what the scheduler asks of one, and
``LoadSchedule``, the cap by load alone (vLLM's and TensorRT-LLM's draft-length schedule;
``adaptive.AdaptiveSchedule`` is the other): ``1:4,3:2,6:0`` verifies at most 4 drafts per
request while 1 or 2 of the pool's slots are busy, 2 from 3 on, none (target-only steps) from 6 on.

A verify row is nearly free while the target is bound by reading its weights, and costs its full
compute once the batch's rows make it compute-bound; so the rows worth verifying shrink as slots
fill. ``measure`` times the backend's calls at every batch size on the machine it runs on, and
``choose`` keeps the engine's ``k`` (with the confidence threshold it was built with: the choice for
one sequence) while a verify row costs, relative to its step, what it costs for one sequence, and
cuts the cap in proportion as it gets dearer. (Planning with the draft's acceptance instead would
need acceptance like the traffic's: measured on any fixed prompts it is another domain's.) The
confidence cut still applies below the cap.

A row's cost is a difference of two timings, which on a shared machine moves by 10-20% from one
timing to the next: cutting wherever the point estimates differed by more than a fixed margin
gave another schedule at every start (issue 40). So ``measure`` times the two calls in pairs,
interleaved over the batch sizes in rounds, and ``choose`` cuts only as far as the samples prove
a verify row dearer at 99% confidence, by a rank test on the samples (``proven_ratio``): where
rows cost alike (ONNX Runtime, one call per sequence), the same engine on the same machine keeps
``k`` start after start.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from itertools import zip_longest
from math import comb
from typing import Callable, Protocol

import torch

from runtime.backends.base import Backend, torch_threads
from runtime.decoding.acceptance import Acceptance
from runtime.decoding.adaptive import AdaptiveSchedule, StepCosts

ADAPTIVE = "adaptive"


class DraftSchedule(Protocol):
    """What the scheduler asks of a draft schedule: a new request's acceptance estimate
    (``estimate``; None for a schedule that reads none), the cap of a call (``cap``: ``drafters``
    the estimates of its requests with speculation, ``others`` how many more emit a token each,
    ``batch`` its sequences, ``busy`` the pool's occupied slots), and a request's step
    (``record``: ``verified`` drafts of at most ``cap``, ``accepted`` of them). A cap reads only
    earlier steps, so that sampling stays exact."""

    def estimate(self) -> Acceptance | None: ...

    def cap(self, drafters: list[Acceptance | None], others: int, batch: int, busy: int) -> int: ...

    def record(self, acceptance: Acceptance | None, cap: int, verified: int, accepted: int) -> None: ...


@dataclass(frozen=True)
class LoadSchedule:
    """``steps``: ``(busy, drafts)`` pairs, ``busy`` ascending from 1: from ``busy`` occupied
    slots on, at most ``drafts`` drafts per request per step."""
    steps: tuple[tuple[int, int], ...]

    @classmethod
    def constant(cls, drafts: int) -> "LoadSchedule":
        return cls(((1, drafts),))

    @classmethod
    def parse(cls, text: str, k: int, flag: str = "--draft-schedule") -> "LoadSchedule | None":
        """``"1:4,3:2,6:0"`` (or one number: that cap at every load), refused in one line;
        ``"adaptive"`` is None: adaptive verification, measured where the engine runs
        (``adaptive.py``)."""
        if text == ADAPTIVE:
            return None
        expected = (f"expected {ADAPTIVE}, or BUSY:DRAFTS pairs with BUSY rising from 1 and DRAFTS "
                    f"0 .. {k} (the engine's k), e.g. 1:{k},4:{k // 2},8:0, or one number")
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

    # a DraftSchedule: a cap by load alone, whatever the drafts' acceptance
    def estimate(self) -> None:
        return None

    def cap(self, drafters: list, others: int, batch: int, busy: int) -> int:
        return self.drafts(busy)

    def record(self, acceptance, cap: int, verified: int, accepted: int) -> None:
        pass

    def __str__(self) -> str:
        return ",".join(f"{b}:{d}" for b, d in self.steps)


@dataclass(frozen=True)
class CallTimings:
    """Seconds per target call with ``b`` busy slots (index ``b - 1``), one sample per round: on
    one row (``one``) and on ``k + 1`` rows per sequence (``full``), a call of ``b`` sequences, or
    of the whole pool on a pooled backend. ``one[b - 1][i]`` and ``full[b - 1][i]`` were timed
    back to back."""
    one: list[list[float]]
    full: list[list[float]]
    draft: list[list[float]] = field(default_factory=list)   # a draft call right after the pair

    @property
    def target_one(self) -> list[float]:
        """The median one-row call at each batch size."""
        return [statistics.median(samples) for samples in self.one]

    @property
    def target_full(self) -> list[float]:
        """The median ``k + 1``-row call at each batch size."""
        return [statistics.median(samples) for samples in self.full]

    def step_costs(self, k: int) -> StepCosts:
        """The medians, as adaptive verification plans with them."""
        return StepCosts.from_samples(self.one, self.full, self.draft, k)

    def row_costs(self, batch: int, k: int) -> list[float]:
        """What a verify row adds to a step of ``batch`` sequences, relative to the step, from each
        pair: ``(t(k + 1) - t(1)) / (k * t(1))``. A pair's two calls ran back to back, so a slow
        spell that falls on both cancels in the quotient."""
        return [max(full - one, 0.0) / (k * one)
                for one, full in zip(self.one[batch - 1], self.full[batch - 1])]


def _rank_orderings(m: int, n: int) -> list[int]:
    """``counts[u]``: how many of the ``C(m + n, m)`` orderings of ``m`` values among ``n`` others
    put exactly ``u`` of the ``m * n`` pairs with the first value below the second: the
    Mann-Whitney statistic's exact distribution when all ``m + n`` come from one distribution (so
    every ordering is equally likely)."""
    # f(i, j)[u] over i values among j others: the largest of the i + j is either one of the i
    # (below none of the others: f(i - 1, j)) or one of the j (above all i: f(i, j - 1), u + i)
    previous = [[1] for _ in range(n + 1)]                  # f(0, j)
    for i in range(1, m + 1):
        current = [[1]]                                     # f(i, 0)
        for j in range(1, n + 1):
            shifted = [0] * i + current[j - 1]
            current.append([a + b for a, b in zip_longest(previous[j], shifted, fillvalue=0)])
        previous = current
    return previous[n]


def proven_ratio(samples: list[float], baseline: list[float], confidence: float) -> float:
    """How many times ``baseline``'s typical value ``samples``' typical value is at least, at
    ``confidence``: the one-sided bound on a ratio of scales that inverts the Mann-Whitney rank
    test (Hodges-Lehmann's and Moses's interval), the ``c``-th smallest of the pairwise ratios,
    with ``c`` from the test's exact distribution. It assumes nothing of the noise's shape (a
    shared machine's timings are skewed, with wild ones), and it widens with the samples' spread:
    a difference within the spread proves nothing. 0 where the samples are too few to prove any
    bound at ``confidence`` (4 against 4 at 99%)."""
    m, n = len(samples), len(baseline)
    counts = _rank_orderings(m, n)
    # the largest c with P(fewer than c of the pairs below the true ratio) <= 1 - confidence
    allowed, c, below = (1 - confidence) * comb(m + n, m), 0, 0
    while below + counts[c] <= allowed:
        below += counts[c]
        c += 1
    if c == 0:
        return 0.0
    ratios = sorted(s / max(b, 1e-12) for s in samples for b in baseline)
    return ratios[c - 1]


CONFIDENCE = 0.99   # that a cut cap is due to the machine, not to the timings' noise


def choose(costs: CallTimings, k: int, confidence: float = CONFIDENCE) -> LoadSchedule:
    """``k`` drafts for one busy slot; for ``b``, ``k / r`` (rounded; never above ``k``, never
    rising with ``b``), where ``r`` is how many times dearer a verify row of a ``b``-sequence
    step is than one alone, each relative to its step (``CallTimings.row_costs``), as far as the samples
    prove it at ``confidence`` (``proven_ratio``). Cutting on the point estimates instead cut on
    noise: a difference of two timings moves by 10-20% on a shared machine."""
    if not k:
        return LoadSchedule.constant(0)
    alone = costs.row_costs(1, k)
    caps = [k]
    for batch in range(2, len(costs.one) + 1):
        dearer = proven_ratio(costs.row_costs(batch, k), alone, confidence)
        cap = k if dearer <= 1 else min(k, round(k / dearer))
        caps.append(min(cap, caps[-1]))
    steps = [(1, caps[0])] + [(b + 1, c) for b, c in enumerate(caps) if b and c != caps[b - 1]]
    return LoadSchedule(tuple(steps))


# 5 samples of each cost prove a ratio at 99% (the 2nd smallest of 25 pairwise ratios); the demo
# engine at 2 threads on a 2-core CPU takes ~1.7 s for them, 4-8 s while other work shares the cores
ROUNDS = 5


def adaptive(backend: Backend, repeats: int = ROUNDS) -> AdaptiveSchedule:
    """Adaptive verification with this backend's call costs, measured now (``measure``)."""
    return AdaptiveSchedule(measure(backend, repeats)[1].step_costs(backend.limits.k), backend.limits.k)


def _seconds(call: Callable[[], object]) -> float:
    begin = time.perf_counter()
    call()
    return time.perf_counter() - begin


def measure(backend: Backend, repeats: int = ROUNDS) -> tuple[LoadSchedule, CallTimings]:
    """The schedule for this machine from ``repeats`` rounds of timings, after one untimed pair
    (a session's first calls set up its memory and threads). A round times a one-row and a
    ``k + 1``-row call back to back at every batch size, alternating which call goes first and
    the order of the batch sizes from round to round, so that a slow spell of a shared machine or
    a drift in its clock falls on every batch size and both calls alike instead of on one
    batch size's samples. The backend's caches hold junk afterwards: start or clear them."""
    limits = backend.limits
    backend.start(limits.max_batch)
    k, device = limits.k, backend.device
    position = min(256, limits.capacity - limits.lookahead - 1)
    # a pooled backend's step runs the whole pool whatever the load: one call to time
    sizes = [limits.max_batch] if backend.pooled else list(range(1, limits.max_batch + 1))

    def target(batch: int, rows: int) -> Callable[[], object]:
        slots = None if backend.pooled else list(range(batch))
        start = torch.full((batch,), position, device=device)
        ids = torch.zeros(batch, rows, dtype=torch.long, device=device)
        positions = torch.arange(rows, device=device).expand(batch, rows)
        state_slot = torch.zeros_like(start)
        return lambda: backend.target_step(ids, start, positions, state_slot, positions, slots=slots)

    def draft(batch: int, aux: torch.Tensor) -> Callable[[], object]:
        """A draft call inserting two rows of context (a step that accepted one draft)."""
        slots = None if backend.pooled else list(range(batch))
        ctx = aux[:, :2].clone()
        start = torch.full((batch,), position, device=device)
        count = torch.full((batch,), 2, device=device)
        noise = torch.zeros(batch, k, limits.vocab_size, device=device)
        return lambda: backend.draft_step(ctx, start, count, start * 0, torch.ones(batch, device=device),
                                          noise, slots=slots)

    one, full = {batch: [] for batch in sizes}, {batch: [] for batch in sizes}
    drafted = {batch: [] for batch in sizes}
    # the loop's own torch threads (``Hints.host_threads``): more spin and slow the calls
    with torch.inference_mode(), torch_threads(backend.hints.host_threads):
        calls = {batch: (target(batch, 1), target(batch, k + 1)) for batch in sizes}
        drafts = {batch: draft(batch, calls[batch][1]()[1]) for batch in sizes} if k else {}
        for call in calls[sizes[0]]:
            call()
        for round_ in range(repeats):
            forward = round_ % 2 == 0
            for batch in sizes if forward else sizes[::-1]:
                pair = [(one[batch], calls[batch][0]), (full[batch], calls[batch][1])]
                for samples, call in pair if forward else pair[::-1]:
                    samples.append(_seconds(call))
                if k:   # after a target call, as when decoding (its weights no longer cached)
                    drafted[batch].append(_seconds(drafts[batch]))
    ones, fulls, draft_calls = [one[b] for b in sizes], [full[b] for b in sizes], [drafted[b] for b in sizes]
    if backend.pooled:
        ones, fulls, draft_calls = (ones * limits.max_batch, fulls * limits.max_batch,
                                    draft_calls * limits.max_batch)
    costs = CallTimings(ones, fulls, draft_calls)
    return choose(costs, k), costs
