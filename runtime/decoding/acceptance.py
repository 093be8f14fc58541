"""Running estimates of what a step's drafts yield, position by position: what adaptive
verification (``adaptive.py``) plans each step with.

Two chains per request. ``accepted`` estimates, at each position ``i + 1``, the chance that the
draft there is accepted given that drafts ``1 .. i`` were: a step that verified at most ``cap``
drafts and accepted ``a`` observes positions ``1 .. min(cap, a + 1)``, accepted at the first
``a``; a draft the confidence cut left out counts as not accepted, so the rates say what a cap
yields with the cut in force. ``confident`` estimates the chance that the cut lets draft ``i + 1``
through given that it let ``1 .. i`` through, from the drafts each step verified: what a cap
costs in verify rows (the cut's rows are verified whether or not an earlier draft is accepted).

Each rate is a Beta posterior mean with forgetting: counts of hits and trials that a step which
observes anything scales by ``1 - 1 / window`` (a request follows its last ~8 verify steps, the
traffic its last ~64), beside a prior worth ``PRIOR_WEIGHT`` trials. A request starts from the
traffic's rates and follows its own drafts as they get better or worse. A step that observes
nothing (a target-only step) forgets four times slower, so that an estimate that turned
verification off drifts back towards the traffic's over tens of steps, not at the next one: a
request whose drafts failed is not tried again every other step (the probes of ``adaptive.py``
find drafts that came back).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import accumulate

REQUEST_WINDOW = 8
TRAFFIC_WINDOW = 64
IDLE_SLOWER = 4   # how many times slower a step that observes nothing forgets
PRIOR_WEIGHT = 2.0
UNKNOWN = 0.5     # the acceptance assumed before anything was observed: verification starts by trying


@dataclass
class Chain:
    """``rates[i]``: the chance of an event at position ``i + 1`` given it at ``1 .. i``; the prior
    is fixed rates, or another chain's as they are now (a request's: the traffic's)."""
    prior: "list[float] | Chain"
    window: int
    hits: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.hits = self.hits or [0.0] * len(self.prior_rates)
        self.trials = self.trials or [0.0] * len(self.prior_rates)

    @property
    def prior_rates(self) -> list[float]:
        return self.prior.rates if isinstance(self.prior, Chain) else self.prior

    @property
    def rates(self) -> list[float]:
        return [(h + PRIOR_WEIGHT * p) / (t + PRIOR_WEIGHT)
                for h, t, p in zip(self.hits, self.trials, self.prior_rates)]

    def observe(self, reached: int, passed: int) -> None:
        """One step: positions ``1 .. min(reached, passed + 1)`` observed, the event at the first
        ``passed`` (``reached`` 0: a step that observed none, which only forgets)."""
        keep = 1 - 1 / (self.window if reached else IDLE_SLOWER * self.window)
        self.hits = [h * keep for h in self.hits]
        self.trials = [t * keep for t in self.trials]
        for i in range(min(reached, passed + 1, len(self.hits))):
            self.trials[i] += 1
            self.hits[i] += i < passed

    def reach(self) -> list[float]:
        """``[i]``: the chance that the event happens at every position ``1 .. i + 1``."""
        return list(accumulate(self.rates, operator.mul))

    def expected(self) -> list[float]:
        """``[c]``: how many of the first ``c`` positions the event is expected to reach, for every
        ``c`` from 0 to the chain's length (one pass: a step plans with all of them)."""
        return list(accumulate(self.reach(), initial=0.0))


@dataclass
class Acceptance:
    accepted: Chain
    confident: Chain
    idle: int = 0                 # steps since the last that verified a draft
    failed_probes: int = 0        # verify steps after idle ones that accepted nothing, in a row

    @classmethod
    def unknown(cls, k: int, window: int = TRAFFIC_WINDOW) -> "Acceptance":
        """Nothing observed yet: acceptance ``UNKNOWN`` at every position, and every draft let
        through the cut (the dearest a cap can be)."""
        return cls(Chain([UNKNOWN] * k, window), Chain([1.0] * k, window))

    def prior(self, window: int = REQUEST_WINDOW) -> "Acceptance":
        """A new estimate whose prior is this one's rates, as they go on moving."""
        return Acceptance(Chain(self.accepted, window), Chain(self.confident, window))

    def record(self, cap: int, verified: int, accepted: int) -> None:
        """A step that verified ``verified`` drafts of at most ``cap`` (0: none was meant to be)
        and accepted ``accepted`` of them."""
        if cap and (accepted or self.idle):   # a probe (a verify step after idle ones) or an accepted draft
            self.failed_probes = 0 if accepted else self.failed_probes + 1
        self.idle = 0 if cap else self.idle + 1
        self.accepted.observe(cap, accepted)
        self.confident.observe(cap, verified)

    def expected_tokens(self) -> list[float]:
        """``[cap]``: tokens a step capped at ``cap`` drafts is expected to emit, the accepted
        drafts and the correction or bonus token after them, for every cap from 0 to k."""
        return [1.0 + drafts for drafts in self.accepted.expected()]

    def expected_rows(self) -> list[float]:
        """``[cap]``: drafts a step capped at ``cap`` is expected to verify, below the confidence cut."""
        return self.confident.expected()
