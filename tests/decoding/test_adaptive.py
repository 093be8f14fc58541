"""Adaptive verification (``runtime/decoding/adaptive.py``, ``acceptance.py``): each step's cap is
the one that pays best for the requests' own acceptance at the call costs; a request whose drafts
stop being accepted takes target-only steps, and gets its drafts back when they come back; the
output stays the target's greedy output."""
import math

import pytest
import torch

from runtime.backends.ort import OrtBackend
from runtime.decoding import adaptive
from runtime.decoding.acceptance import Acceptance, Chain
from runtime.decoding.adaptive import BACKOFF, PROBE_EVERY, AdaptiveSchedule, StepCosts, speedup_bound
from runtime.decoding.batcher import Batcher
from runtime.decoding.params import Params

from conftest import LIMITS, hf_greedy

K = 4
# a target call of 1.0 s, 0.15 s a verify row, 0.3 s the draft call, at every batch size (the demo
# engine's, relative to its one-row step: docs/measurements.md)
COSTS = StepCosts(target=(1.0,) * 4, row=(0.15,) * 4, draft=(0.3,) * 4)
PROMPT = [7, 9]
MAX_NEW = 80
WRONG = range(24, 56)   # the generated positions at which the oracle's drafts are all wrong


def test_a_step_observes_the_positions_its_cap_reached():
    """Capped at 3, one accepted: positions 1 and 2 observed (2 rejected), 3 and 4 not; the cut's
    chain sees the 2 drafts verified and the 3rd cut."""
    estimate = Acceptance(Chain([0.5] * K, 1_000_000), Chain([1.0] * K, 1_000_000))
    estimate.record(cap=3, verified=2, accepted=1)
    accepted, confident = estimate.accepted.rates, estimate.confident.rates
    assert accepted == pytest.approx([(1 + 1) / 3, (0 + 1) / 3, 0.5, 0.5])   # prior 0.5, worth 2
    assert confident == pytest.approx([1.0, 1.0, (0 + 2) / 3, 1.0])          # prior 1.0
    assert estimate.expected_tokens()[2] == pytest.approx(1 + 2 / 3 + 2 / 9)
    estimate.record(cap=0, verified=0, accepted=0)
    assert estimate.idle == 1 and estimate.accepted.rates[0] < 2 / 3         # forgetting: towards 0.5


def test_the_cap_is_the_one_with_the_most_tokens_per_second():
    policy = AdaptiveSchedule(COSTS, K)

    def estimate(rates):
        return Acceptance(Chain(list(rates), 8), Chain([1.0] * K, 8))

    for rates in ([0.9] * 4, [0.5, 0.5, 0.2, 0.1], [0.2, 0.9, 0.9, 0.9], [0.05] * 4, [0.6, 0.0, 0.0, 0.0]):
        drafters = [estimate(rates)]
        speed = [drafters[0].expected_tokens()[c] / COSTS.step(1, c, c > 0) for c in range(K + 1)]
        assert policy.cap(drafters, 0, 1, 1) == max(range(K + 1), key=speed.__getitem__), rates
    assert policy.cap([estimate([0.05] * 4)], 0, 1, 1) == 0
    assert policy.cap([estimate([0.9] * 4)], 0, 1, 1) == K
    idle = estimate([0.05] * 4)
    idle.idle = PROBE_EVERY
    assert policy.cap([idle], 0, 1, 1) == 1, "a request idle for long probes its first draft"
    # each probe that fails doubles the wait before the next, up to BACKOFF times; an accepted one
    # starts over
    for failed in range(1, BACKOFF + 3):
        idle.record(cap=1, verified=1, accepted=0)
        assert idle.failed_probes == failed
        wait = PROBE_EVERY << min(failed, BACKOFF)
        idle.idle = wait - 1
        assert policy.cap([idle], 0, 1, 1) == 0
        idle.idle = wait
        assert policy.cap([idle], 0, 1, 1) == 1
    idle.record(cap=1, verified=1, accepted=1)
    assert idle.failed_probes == 0
    # the bound's best cap at the same rates is the policy's
    bound, cap = speedup_bound(COSTS, [0.9] * 4, [1.0] * 4, target_step=1.0)
    speedup = estimate([0.9] * 4).expected_tokens()[K] / COSTS.step(1, K, True)
    assert cap == K and bound == pytest.approx(speedup)


def test_a_call_of_several_requests_pays_for_its_widest_one():
    """Every sequence of a call computes the rows of the one that verifies the most drafts, so a
    call of 4 costs the expected maximum of their verified drafts: the cap equals the best one by
    brute force over every combination of the 4 requests' draft counts. A request that alone
    would verify all 4 drafts may, with 3 more like it, verify none."""
    import itertools

    policy = AdaptiveSchedule(COSTS, K)

    def best_by_enumeration(drafters):
        speeds = []
        for cap in range(K + 1):
            counts = []   # each request's P(it verifies j drafts), j = 0 .. cap
            for estimate in drafters:
                reach = [1.0, *estimate.confident.reach()]
                exactly = [reach[j] - (reach[j + 1] if j < K else 0.0) for j in range(K + 1)]
                counts.append([*exactly[:cap], sum(exactly[cap:])])
            width = sum(math.prod(c[j] for c, j in zip(counts, combo)) * max(combo)
                        for combo in itertools.product(range(cap + 1), repeat=len(drafters)))
            tokens = sum(estimate.expected_tokens()[cap] for estimate in drafters)
            speeds.append(tokens / COSTS.step(len(drafters), width, cap > 0))
        return max(range(K + 1), key=lambda cap: (speeds[cap], -cap))

    for accepted, confident in (([0.4, 0.3, 0.3, 0.3], [0.5] * 4), ([0.5, 0.4, 0.3, 0.3], [0.6] * 4),
                                ([0.6, 0.5, 0.4, 0.3], [0.5] * 4), ([0.7, 0.6, 0.5, 0.5], [0.3] * 4)):
        drafters = [Acceptance(Chain(accepted, 8), Chain(confident, 8)) for _ in range(4)]
        assert policy.cap(drafters, 0, 4, 4) == best_by_enumeration(drafters), (accepted, confident)
        assert policy.cap(drafters[:1], 0, 1, 1) >= policy.cap(drafters, 0, 4, 4)
    alike = [Acceptance(Chain([0.4, 0.3, 0.3, 0.3], 8), Chain([0.5] * 4, 8))] * 4
    assert policy.cap(alike[:1], 0, 1, 1) == K and policy.cap(alike, 0, 4, 4) == 0


class Switching(OrtBackend):
    """Drafts the request's true continuation, except at the generated positions in ``WRONG``,
    where every draft is a token the target does not emit."""

    def draft_step(self, ctx_aux, ctx_start, ctx_count, anchor, temperature, noise, slots=None):
        tokens, q = super().draft_step(ctx_aux, ctx_start, ctx_count, anchor, temperature, noise,
                                       slots=slots)
        tokens = tokens.clone()
        generated = int(ctx_start[0] + ctx_count[0]) - len(PROMPT) + 1   # the first draft's index
        truth = torch.tensor((self.truth + [0] * (K + 1))[generated:generated + K])
        tokens[0] = (truth + 1) % self.limits.vocab_size if generated in WRONG else truth
        return tokens, q


def test_drafts_that_stop_and_come_back(tiny, engine_dir, monkeypatch):
    """Right drafts: every step verifies all k. Wrong ones: once the request's estimate has
    forgotten its good steps (window 8: a dozen steps from all accepted to unprofitable), it takes
    target-only steps, verifying one draft after ``PROBE_EVERY`` of them (8 here) and, that probe
    failing, the next after twice as many. Right again: a probe finds it and verification comes
    back. The output is the target's greedy output throughout."""
    probe = 8
    monkeypatch.setattr(adaptive, "PROBE_EVERY", probe)
    backend = Switching(engine_dir(LIMITS, arch="qwen3"))
    backend.truth = hf_greedy(tiny(arch="qwen3")[0], [PROMPT], MAX_NEW, eos=None)[0]
    batcher = Batcher(backend, eos_token_ids=(), confidence_threshold=0,
                      draft_schedule=AdaptiveSchedule(COSTS, K))
    request = batcher.submit(PROMPT, Params(max_new_tokens=MAX_NEW))
    batcher.run()
    assert request.token_ids == backend.truth
    drafts, generated = {}, 0    # tokens generated before a step -> how many drafts it verified
    for record in request.trace:
        if record["step"]:
            drafts[generated] = len(record["drafts"])
        generated += len(record["emitted"])
    before = [n for at, n in drafts.items() if at < WRONG.start]
    during = [n for at, n in drafts.items() if WRONG.start + 16 <= at < WRONG.stop]
    after = [n for at, n in drafts.items() if at >= WRONG.stop + 2 * probe + 2]
    # from the traffic's unknown rates up to every draft, as the right ones are accepted
    assert before == sorted(before) and before[-2:] == [K, K], drafts
    # idle, one probe that fails, then twice the wait: no second probe while the drafts are wrong
    assert len(during) >= 2 * probe and set(during) <= {0, 1} and during.count(1) == 1, drafts
    assert after and set(after) == {K}, drafts
    assert request.stats.idle_steps >= 2 * probe
