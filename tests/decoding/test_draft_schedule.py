"""The draft-length schedule (``runtime/decoding/draft_schedule.py``): its flag's syntax, and the cap it
chooses from measured costs: the same on every start where rows cost alike, whatever the noise."""
from __future__ import annotations

import random
from math import comb

import pytest

from runtime.decoding.draft_schedule import (
    ROUNDS,
    CallTimings,
    LoadSchedule,
    _rank_orderings,
    choose,
    proven_ratio,
)

K = 4


def test_the_flag_reads_busy_drafts_pairs_or_one_number():
    schedule = LoadSchedule.parse("1:4,3:2,6:0", K)
    assert [schedule.drafts(b) for b in range(1, 9)] == [4, 4, 2, 2, 2, 0, 0, 0]
    assert str(schedule) == "1:4,3:2,6:0"
    assert LoadSchedule.parse("2", K).drafts(7) == 2


@pytest.mark.parametrize("text", ["", "x", "2:4", "1:4,1:2", "1:4,3:2,2:0", "1:5", "1:-1", "1:4:2", "1:4,"])
def test_a_bad_schedule_is_refused_in_one_line(text):
    with pytest.raises(ValueError, match=r"--draft-schedule .*expected adaptive, or BUSY:DRAFTS .* 0 \.\. 4"):
        LoadSchedule.parse(text, K)


def _timings(rng, seconds: float, rounds: int = ROUNDS) -> list[float]:
    """``rounds`` timings of a call that takes ``seconds``, as a shared machine gives them: 6%
    log-normal jitter, and one call in ten caught by a slow spell (up to 60% longer)."""
    return [seconds * rng.lognormvariate(0, 0.06) * (1 + rng.uniform(0, 0.6) * (rng.random() < 0.1))
            for _ in range(rounds)]


def _costs(rng, one: list[float], full: list[float]) -> CallTimings:
    """Noisy samples of calls whose true times are ``one[b - 1]`` and ``full[b - 1]``."""
    return CallTimings(one=[_timings(rng, t) for t in one], full=[_timings(rng, t) for t in full])


def _points_differ(costs: CallTimings, margin: float = 1.25) -> bool:
    """What the rule before issue 40 cut on: a row's cost from the fastest timing of each call,
    dearer than alone's by more than a fixed 25% at some batch size."""
    def row(b):
        one = min(costs.one[b - 1])
        return (min(costs.full[b - 1]) - one) / (K * one)
    return any(row(b) > margin * row(1) for b in range(2, len(costs.one) + 1))


def test_noisy_rows_that_cost_alike_keep_every_draft_on_every_start():
    """One sequence per call (ONNX Runtime's CPU backend): a step of b sequences costs b times
    one, so a row's relative cost is the same at every load and the schedule is k throughout.
    200 starts with the noise of a shared machine: every one keeps k, where the fixed 25% margin
    on the fastest timings cut on 68 of them (issue 40: 7 starts, 7 schedules)."""
    rng = random.Random(40)
    one, full = [0.014 * b for b in range(1, 5)], [0.020 * b for b in range(1, 5)]
    starts = [_costs(rng, one, full) for _ in range(200)]
    assert sum(map(_points_differ, starts)) > 50, "the noise is enough to fool point estimates"
    assert {str(choose(costs, K)) for costs in starts} == {str(LoadSchedule.constant(K))}


def test_clearly_dearer_rows_are_cut_on_every_start():
    """Rows that cost six times alone's from 3 busy slots on (relative to their step: a batch
    gone compute-bound) are cut there on every start; how far is what the samples prove, never
    below what the true ratio gives (k / 6, rounded) and never rising with the load."""
    rng = random.Random(41)
    one = [0.014 * b for b in range(1, 5)]
    full = [t * (1 + K * 0.1 * (6 if b >= 3 else 1)) for b, t in enumerate(one, 1)]
    for _ in range(50):
        schedule = choose(_costs(rng, one, full), K)
        caps = [schedule.drafts(b) for b in range(1, 5)]
        assert caps[:2] == [K, K] and K > caps[2] >= caps[3] >= round(K / 6)


def test_drafts_are_turned_down_as_rows_become_compute():
    """A batched GPU step: one row per sequence costs about the same at any batch size, k + 1
    rows per sequence cost more and more as the batch becomes compute: the cap falls with the
    batch, down to target-only steps, and never rises again."""
    batches = range(1, 17)
    costs = _costs(random.Random(42), one=[1.0 + 0.01 * b for b in batches],
                   full=[1.0 + 0.01 * b + 0.1 * K * b for b in batches])
    caps = [choose(costs, K).drafts(b) for b in batches]
    assert caps[0] == K and caps[-1] == 0
    assert caps == sorted(caps, reverse=True) and len(set(caps)) > 2


def test_too_few_samples_prove_nothing_and_keep_every_draft():
    """One timing per call (``measure(repeats=1)``) or 4 against 4 cannot prove a ratio at 99%:
    the cap stays at k however far the timings lie apart."""
    assert proven_ratio([9.0] * 4, [1.0] * 4, 0.99) == 0.0
    assert proven_ratio([9.0] * 5, [1.0] * 5, 0.99) == 9.0
    costs = CallTimings(one=[[1.0], [2.0]], full=[[1.1], [9.0]])
    assert choose(costs, K) == LoadSchedule.constant(K)


def test_the_rank_bound_holds_as_often_as_its_confidence_says():
    """The bound's null distribution is the exact one (every ordering counted once), and on
    samples ``ratio`` times the baseline's, the bound lies above ``ratio`` in at most 1% of draws
    (at 99%) and 5% (at 95%)."""
    assert all(sum(_rank_orderings(m, n)) == comb(m + n, m) for m in range(1, 7) for n in range(1, 7))
    rng = random.Random(43)
    for confidence in (0.99, 0.95):
        above = sum(proven_ratio([2 * rng.lognormvariate(0, 0.3) for _ in range(6)],
                                 [rng.lognormvariate(0, 0.3) for _ in range(6)], confidence) > 2
                    for _ in range(2000))
        assert above <= (1 - confidence) * 2000 * 1.3
