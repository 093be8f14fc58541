"""Adaptive verification: each step verifies as many drafts as pay for themselves, judged by the
running requests' own acceptance (``acceptance.py``) and by what the calls cost on this machine.

A step of ``B`` sequences capped at ``w`` drafts each costs ``StepCosts.step(B, rows, w > 0)``:
the target call on one row per sequence, ``rows`` more rows per sequence (the call's width: the
expected most drafts that one of its requests verifies below the confidence cut at that cap,
``widest_rows``), and the draft call when ``w > 0``,
each measured at start (``draft_schedule.measure``, interleaved rounds, medians). It emits
``sum_b E_b(w)`` tokens, ``E_b`` request ``b``'s expected tokens at cap ``w``. The step takes
the ``w`` with the most tokens per second, ``w = 0`` included: a request whose drafts stop being
accepted stops paying for the draft call and the verify rows, and takes target-only steps. A
request that has verified nothing for ``PROBE_EVERY`` steps makes the next step verify one draft,
so that drafts that come back get verified again; each probe that fails doubles the wait before
the next (``probe_after``), as a client backs off a service that keeps failing. The confidence
cut still applies below the cap.

This is SGLang's and vLLM's adaptive speculation (a draft length per step from acceptance
observed online) with the cost model measured rather than assumed. Planning on the past keeps
sampling exact: a step's cap depends only on earlier steps, never on the drafts it verifies.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from itertools import accumulate

from runtime.decoding.acceptance import Acceptance, Chain

PROBE_EVERY = 16   # idle steps before a request probes its drafts again (one draft: ~1/4 of a step)
BACKOFF = 3        # each probe that fails doubles the wait, up to 2^3 times (128 steps)


@dataclass(frozen=True)
class StepCosts:
    """Seconds per call with ``b`` sequences (index ``b - 1``): the target on one row each
    (``target``), what each further verify row per sequence adds (``row``), the draft call
    (``draft``, timed right after a target call, as it runs when decoding)."""
    target: tuple[float, ...]
    row: tuple[float, ...]
    draft: tuple[float, ...]

    @classmethod
    def from_samples(cls, one: list[list[float]], full: list[list[float]], draft: list[list[float]],
                     k: int) -> "StepCosts":
        """The medians of ``measure``'s samples: one-row and ``k + 1``-row target calls timed back
        to back, and draft calls, per batch size."""
        median = statistics.median
        return cls(tuple(map(median, one)),
                   tuple(max(median(f) - median(o), 0.0) / max(k, 1) for o, f in zip(one, full)),
                   tuple(map(median, draft)))

    def step(self, batch: int, rows: float, drafting: bool) -> float:
        """A decode call of ``batch`` sequences verifying ``rows`` drafts each."""
        b = min(batch, len(self.target)) - 1
        return self.target[b] + rows * self.row[b] + (self.draft[b] if drafting else 0.0)


class AdaptiveSchedule:
    """The draft cap of each step from the requests' acceptance; ``traffic`` is the estimate over
    every request served so far, which a new request starts from (``estimate``)."""

    def __init__(self, costs: StepCosts, k: int):
        self.costs, self.k = costs, k
        self.traffic = Acceptance.unknown(k)

    def __str__(self) -> str:
        return "adaptive"

    def estimate(self) -> Acceptance:
        return self.traffic.prior()

    def cap(self, drafters: list[Acceptance], others: int, batch: int, busy: int) -> int:
        """The cap for a call of ``batch`` sequences: ``drafters`` the estimates of those with
        speculation, ``others`` how many more emit a token each (``busy`` is not read: the
        costs are the call's)."""
        tokens = [others + sum(by_request) for by_request in zip(*(a.expected_tokens() for a in drafters))]
        rows = widest_rows([a.confident.reach() for a in drafters])
        best = max(range(self.k + 1),
                   key=lambda cap: (tokens[cap] / self.costs.step(batch, rows[cap], cap > 0), -cap))
        if best == 0 and any(a.idle >= probe_after(a) for a in drafters):
            return 1
        return best

    def record(self, acceptance: Acceptance, cap: int, verified: int, accepted: int) -> None:
        """A request's step: ``verified`` drafts of at most ``cap`` (0: none), ``accepted`` of them."""
        acceptance.record(cap, verified, accepted)
        if cap:
            self.traffic.record(cap, verified, accepted)


def widest_rows(reach: list[list[float]]) -> list[float]:
    """``[cap]``: the verify rows a call is expected to compute at each cap, its sequences' ``reach``
    the chances that the confidence cut lets each of their drafts through. Every sequence of a call
    computes the rows of its widest one, so this is the expected maximum, not the largest
    expectation: ``P(widest >= j) = 1 - prod_b (1 - reach_b[j])`` (four sequences that each pass
    a draft one time in two make calls one row wide 15 times in 16)."""
    at_least = [1 - math.prod(1 - r[j] for r in reach) for j in range(len(reach[0]))]
    return list(accumulate(at_least, initial=0.0))


def probe_after(acceptance: Acceptance) -> int:
    """Idle steps before the request's next probe: ``PROBE_EVERY``, doubled by each probe in a row
    that found its draft rejected (at most ``BACKOFF`` times), so that a request whose drafts stay
    wrong pays for a probe every 128 steps rather than every 16; an accepted draft starts over."""
    return PROBE_EVERY << min(acceptance.failed_probes, BACKOFF)


def speedup_bound(costs: StepCosts, accepted: list[float], confident: list[float],
                  target_step: float) -> tuple[float, int]:
    """The speedup over target-only decoding that the best fixed cap gives one sequence whose
    drafts are accepted at ``accepted`` and let through the confidence cut at ``confident`` (per
    position, given the ones before: ``Acceptance``'s chains), with these call costs, for
    target-only steps of ``target_step`` seconds (host work included), and that cap."""
    estimate = Acceptance(Chain(list(accepted), 1), Chain(list(confident), 1))
    caps = range(len(accepted) + 1)
    rows, tokens = estimate.expected_rows(), estimate.expected_tokens()
    extra = [costs.step(1, rows[cap], cap > 0) - costs.step(1, 0, False) for cap in caps]
    speedups = [tokens[cap] * target_step / (target_step + extra[cap]) for cap in caps]
    best = max(range(len(speedups)), key=speedups.__getitem__)
    return speedups[best], best
