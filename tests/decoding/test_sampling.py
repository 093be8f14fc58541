"""Speculative sampling reproduces the target's distribution, and a seed the target's own sample
whatever is drafted and verified (fixed seeds: deterministic)."""
import functools

import pytest
import torch
from scipy.stats import chisquare

from export.onnx_export import BuildLimits
from modeling.pair import load_pair
from modeling.target import from_start
from runtime.backends.ort import OrtBackend
from runtime.backends.pytorch import TorchBackend
from runtime.decoding.adaptive import AdaptiveSchedule, StepCosts
from runtime.decoding.batch import generate
from runtime.decoding.batcher import Batcher
from runtime.decoding.draft_schedule import LoadSchedule
from runtime.decoding.noise import Noise
from runtime.decoding.params import Params
from runtime.decoding.sampling import argmax, probabilities, scores
from runtime.decoding.stats import SpecStats

from conftest import median_confidence

PROMPT = [5, 6, 7, 8, 9, 10]
SAMPLES = 4000


def _chi_square_p(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of ``samples`` (ids) against the distribution ``expected``, pooling rare ids."""
    observed = torch.bincount(samples, minlength=len(expected)).double()
    counts = expected.double() * len(samples)
    if (observed[counts == 0] > 0).any():   # an impossible id was drawn
        return 0.0
    observed, counts = observed[counts > 0], counts[counts > 0]
    common = counts >= 5
    obs, exp = observed[common], counts[common]
    if not common.all():
        obs = torch.cat([obs, observed[~common].sum()[None]])
        exp = torch.cat([exp, counts[~common].sum()[None]])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@functools.lru_cache
def _exact_marginals(target, temperature, top_k=0):
    """Exact distributions of generated tokens 2 and 3 under the target alone (the target's
    next-token distribution after V + V^2 prefixes: computed once per target and setting)."""
    def next_probs(prefixes):
        ids = torch.tensor(prefixes)
        logits, _ = from_start(target, ids, torch.full((len(ids), 1), ids.shape[1] - 1))
        return probabilities(logits[:, 0], temperature, top_k=top_k)

    vocab = target.config.vocab_size
    p1 = next_probs([PROMPT])[0]
    p2_given_1 = next_probs([PROMPT + [a] for a in range(vocab)])              # [V, V]
    joint12 = p1[:, None] * p2_given_1
    p3_given_12 = next_probs([PROMPT + [a, b] for a in range(vocab) for b in range(vocab)])
    return joint12.sum(0), (joint12.reshape(-1, 1) * p3_given_12).sum(0)


SPEC = dict(arch="qwen3", draft_vocab=60)


@pytest.fixture(scope="module")
def pair(tiny):
    return load_pair(*tiny(**SPEC))


@pytest.fixture(scope="module")
def ort_backend(engine_dir):
    return OrtBackend(engine_dir(BuildLimits(max_batch=SAMPLES, max_seq_len=16, max_prompt_chunk=8), **SPEC))


def _sample(pair, temperature, backend=None, top_k=0, **options):
    backend = backend or TorchBackend(*pair, capacity=16)
    result = generate(backend, [PROMPT] * SAMPLES, max_new_tokens=3, temperature=temperature, seed=1,
                      top_k=top_k, **options)
    tokens = torch.tensor(result.token_ids)
    return tokens, result.stats


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculative_sampling_matches_target_distribution(pair, temperature):
    tokens, stats = _sample(pair, temperature)
    p2, p3 = _exact_marginals(pair[0], temperature)
    # both acceptance and rejection happen, so both branches are under test
    assert 0.05 < stats.acceptance_per_position[0] < 0.9
    assert _chi_square_p(tokens[:, 1], p2) > 1e-3
    assert _chi_square_p(tokens[:, 2], p3) > 1e-3


@pytest.mark.slow
def test_hybrid_speculative_sampling_matches_target_distribution(tiny):
    """Sampling over a Qwen3.5 hybrid target: its recurrent state restored from the accepted slot
    after every acceptance and rejection."""
    pair = load_pair(*tiny(arch="qwen3_5", draft_vocab=60))
    tokens, stats = _sample(pair, 1.0)
    p2, p3 = _exact_marginals(pair[0], 1.0)
    assert stats.accepted_tokens > 50 and stats.acceptance_per_position[0] < 0.9   # both branches
    assert _chi_square_p(tokens[:, 1], p2) > 1e-3
    assert _chi_square_p(tokens[:, 2], p3) > 1e-3


@pytest.mark.slow
def test_top_k_sampling_matches_the_targets_top_k_distribution(pair):
    """With ``top_k`` the drafts still come from the draft's own distribution, and the target's
    tokens from its top-k distribution: no token outside each step's k most likely."""
    tokens, stats = _sample(pair, 1.0, top_k=3)
    p2, p3 = _exact_marginals(pair[0], 1.0, top_k=3)
    assert stats.accepted_tokens > 50 and stats.acceptance_per_position[0] < 0.9   # both branches
    assert _chi_square_p(tokens[:, 1], p2) > 1e-3 and _chi_square_p(tokens[:, 2], p3) > 1e-3
    untruncated, _ = _exact_marginals(pair[0], 1.0)
    assert _chi_square_p(tokens[:, 1], untruncated) < 1e-6   # the test tells top-k from none


@pytest.mark.slow
def test_onnx_runtime_sampling_matches_target_distribution(pair, ort_backend):
    """The same check through the exported graphs: Gumbel-max drafts inside the draft graph with
    each position's noise, the target's token under the same noise on the host."""
    tokens, stats = _sample(pair, 1.0, ort_backend)
    p2, p3 = _exact_marginals(pair[0], 1.0)
    assert 0.05 < stats.acceptance_per_position[0] < 0.9
    assert _chi_square_p(tokens[:, 1], p2) > 1e-3
    assert _chi_square_p(tokens[:, 2], p3) > 1e-3


@pytest.mark.slow
def test_noise_that_does_not_change_with_the_position_is_detected(pair, monkeypatch):
    """A bug the keyed noise invites: every token of a request drawn with the same vector."""
    row = Noise._row
    monkeypatch.setattr(Noise, "_row", lambda self, index: row(self, 0))
    tokens, _ = _sample(pair, 1.0)
    p2, p3 = _exact_marginals(pair[0], 1.0)
    assert min(_chi_square_p(tokens[:, 1], p2), _chi_square_p(tokens[:, 2], p3)) < 1e-6


@pytest.mark.parametrize("verified", ["adaptive", 0, 1, 3], ids=lambda v: f"verifying-{v}")
def test_a_seed_samples_the_targets_own_tokens_whatever_is_verified(pair, verified):
    """Each position's noise is the seed's (``noise.py``): speculative output equals target-only
    output seed by seed, token for token, at any cap and with the adaptive one, as greedy output
    is the target's argmax; and drafts are accepted (the drafter is not inert)."""
    backend = TorchBackend(*pair, capacity=24, max_batch=64)
    schedule = (AdaptiveSchedule(NEAR_BREAK_EVEN, pair[1].k) if verified == "adaptive"
                else LoadSchedule.constant(verified))
    options = dict(max_new_tokens=12, temperature=0.8, top_p=0.95, seed=100)
    alone = generate(backend, [PROMPT] * 64, speculative=False, **options)
    speculative = generate(backend, [PROMPT] * 64, draft_schedule=schedule, **options)
    assert speculative.token_ids == alone.token_ids
    assert len({tuple(t) for t in alone.token_ids}) > 32          # the seeds differ
    if verified != 0:
        assert speculative.stats.accepted_tokens > 0.02 * speculative.stats.verified > 0


def test_a_token_is_distributed_as_p_and_agrees_with_the_draft_as_a_coupling_bounds():
    """Unit check on synthetic distributions: the argmax of ``scores`` under Gumbel noise is a
    sample of ``p`` (top-p applied); the draft's choice under the same noise agrees with it at least
    ``(1 - d) / (1 + d)`` of the time (Daliri et al., 2024) and, as any coupling, at most
    ``1 - d``, ``d`` the total-variation distance."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 8, 20000
    logits, draft_logits = torch.randn(vocab, generator=g), 2 * torch.randn(vocab, generator=g)
    p, q = probabilities(logits, 1.0, top_p=0.9), probabilities(draft_logits, 1.0)
    noise = -torch.log(-torch.log(torch.rand(n, vocab, generator=g)))
    tokens = argmax(scores(logits.expand(n, -1), noise, 1.0, top_p=0.9))
    drafts = argmax(torch.log(q) + noise)
    assert _chi_square_p(tokens, p) > 1e-3
    d = float((p - q).abs().sum() / 2)
    agree = float((tokens == drafts).float().mean())
    assert (1 - d) / (1 + d) - 0.01 < agree < 1 - d + 0.01


def _sample_with_threshold(pair, threshold):
    result = generate(TorchBackend(*pair, capacity=16), [PROMPT] * SAMPLES, max_new_tokens=3,
                      temperature=1.0, seed=1, confidence_threshold=threshold)
    proposed = {len(r["drafts"]) for r in result.trace if r["step"] > 0}
    return torch.tensor(result.token_ids), result.stats, proposed


@pytest.mark.slow
@pytest.mark.parametrize("cut", ["median", "all"])
def test_sampling_with_a_confidence_threshold_matches_target_distribution(pair, cut):
    """Cutting each sequence's drafts at the first unconfident one keeps the output exact: at the
    median confidence sequences propose from none to all k drafts side by side in one batch; at 1.0
    no step verifies a draft."""
    threshold = median_confidence(pair, [PROMPT] * 64, 3, 1.0) if cut == "median" else 1.0
    tokens, stats, proposed = _sample_with_threshold(pair, threshold)
    if cut == "median":
        assert proposed == set(range(pair[1].k + 1))
        assert 0.05 < stats.acceptance_per_position[0] < 0.9
    else:
        assert proposed == {0} and stats.tau == 1.0
    p2, p3 = _exact_marginals(pair[0], 1.0)
    assert _chi_square_p(tokens[:, 1], p2) > 1e-3
    assert _chi_square_p(tokens[:, 2], p3) > 1e-3


# costs at which this draft's acceptance is near break-even, so that adaptive caps vary step by step
NEAR_BREAK_EVEN = StepCosts(target=(1.0,) * 16, row=(0.1,) * 16, draft=(0.4,) * 16)


@pytest.mark.slow
@pytest.mark.parametrize("adaptive", [False, True])
def test_sampling_through_the_scheduler_matches_target_distribution(pair, adaptive):
    """Continuous batching: half the samples, as requests of their own seeds through 16 slots,
    each slot refilled as soon as its request ends (which, with acceptance, varies), so requests
    join and leave mid-run beside others at every stage. (Each prompt is prefilled alone, which
    is what makes this test slower than the batch's.) Adaptive: each step's cap from the
    requests' acceptance so far, from none to all k, and the output still the target's
    distribution."""
    backend = TorchBackend(*pair, capacity=16, max_batch=16, max_prompt_chunk=8)
    policy = AdaptiveSchedule(NEAR_BREAK_EVEN, pair[1].k) if adaptive else None
    batcher = Batcher(backend, eos_token_ids=(), draft_schedule=policy)
    requests = [batcher.submit(PROMPT, Params(max_new_tokens=3, temperature=1.0, seed=i))
                for i in range(SAMPLES // 2)]
    batcher.run()
    tokens = torch.tensor([r.token_ids for r in requests])
    stats = SpecStats(k=pair[1].k)
    for r in requests:
        stats.merge(r.stats)
    p2, p3 = _exact_marginals(pair[0], 1.0)
    assert 0.05 < stats.acceptance_per_position[0] < 0.9
    if adaptive:   # steps that verified none and steps that verified several
        assert stats.idle_steps > 100 and stats.verified > 2 * stats.steps
    assert _chi_square_p(tokens[:, 1], p2) > 1e-3
    assert _chi_square_p(tokens[:, 2], p3) > 1e-3
