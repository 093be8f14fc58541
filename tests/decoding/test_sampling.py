"""Speculative sampling reproduces the target's distribution (fixed seeds: deterministic)."""
import pytest
import torch
from scipy.stats import chisquare

import runtime.decoding.step
from export.onnx_export import Limits
from modeling.pair import load_pair
from modeling.target import from_start
from runtime.backends.ort import OrtBackend
from runtime.backends.pytorch import TorchBackend
from runtime.decoding.adaptive import AdaptiveVerification, StepCosts
from runtime.decoding.batch import generate
from runtime.decoding.sampling import draw, pick, probabilities
from runtime.decoding.scheduler import Params, Scheduler
from runtime.decoding.stats import SpecStats
from runtime.decoding.verify import rejection_verify

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


def _exact_marginals(target, temperature, top_k=0):
    """Exact distributions of generated tokens 2 and 3 under the target alone."""
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
    return OrtBackend(engine_dir(Limits(max_batch=SAMPLES, max_seq_len=16, max_prompt_chunk=8), **SPEC))


def _sample(pair, temperature, backend=None, top_k=0):
    backend = backend or TorchBackend(*pair, capacity=16)
    result = generate(backend, [PROMPT] * SAMPLES, max_new_tokens=3, temperature=temperature, seed=1,
                      top_k=top_k)
    tokens = torch.tensor(result.token_ids)
    return tokens, result.stats


def _wrong_rule_resample_from_p(drafts, q, p, uniform, limit=None):
    """A classic bug: on rejection, draw from p instead of the residual max(p - q, 0)."""
    accepted, emitted = rejection_verify(drafts, q, p, uniform, limit)
    rows = torch.arange(len(drafts))
    emitted[rows, accepted] = pick(p[rows, accepted], uniform[:, -1])
    return accepted, emitted


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculative_sampling_matches_target_distribution(pair, temperature):
    tokens, stats = _sample(pair, temperature)
    p2, p3 = _exact_marginals(pair[0], temperature)
    # both acceptance and rejection happen, so both branches are under test
    assert 0.1 < stats.acceptance_per_position[0] < 0.9
    assert _chi_square_p(tokens[:, 1], p2) > 1e-3
    assert _chi_square_p(tokens[:, 2], p3) > 1e-3


def test_hybrid_speculative_sampling_matches_target_distribution(tiny):
    """Rejection sampling over a Qwen3.5 hybrid target: its recurrent state restored from the
    accepted slot after every acceptance and rejection."""
    pair = load_pair(*tiny(arch="qwen3_5", draft_vocab=60))
    tokens, stats = _sample(pair, 1.0)
    p2, p3 = _exact_marginals(pair[0], 1.0)
    assert stats.accepted_tokens > 50 and stats.acceptance_per_position[0] < 0.9   # both branches
    assert _chi_square_p(tokens[:, 1], p2) > 1e-3
    assert _chi_square_p(tokens[:, 2], p3) > 1e-3


def test_top_k_sampling_matches_the_targets_top_k_distribution(pair):
    """With ``top_k`` the drafts still come from the draft's own distribution, and rejection
    sampling against the target's top-k distribution gives exactly that distribution: no token
    outside each step's k most likely."""
    tokens, stats = _sample(pair, 1.0, top_k=3)
    p2, p3 = _exact_marginals(pair[0], 1.0, top_k=3)
    assert stats.accepted_tokens > 50 and stats.acceptance_per_position[0] < 0.9   # both branches
    assert _chi_square_p(tokens[:, 1], p2) > 1e-3 and _chi_square_p(tokens[:, 2], p3) > 1e-3
    untruncated, _ = _exact_marginals(pair[0], 1.0)
    assert _chi_square_p(tokens[:, 1], untruncated) < 1e-6   # the test tells top-k from none


def test_onnx_runtime_sampling_matches_target_distribution(pair, ort_backend):
    """The same check through the exported graphs: Gumbel-max drafts inside the draft graph,
    rejection sampling on the host."""
    tokens, stats = _sample(pair, 1.0, ort_backend)
    p2, p3 = _exact_marginals(pair[0], 1.0)
    assert 0.1 < stats.acceptance_per_position[0] < 0.9
    assert _chi_square_p(tokens[:, 1], p2) > 1e-3
    assert _chi_square_p(tokens[:, 2], p3) > 1e-3


def test_a_wrong_acceptance_rule_is_detected(pair, monkeypatch):
    monkeypatch.setattr(runtime.decoding.step, "rejection_verify", _wrong_rule_resample_from_p)
    tokens, _ = _sample(pair, 1.0)
    p2, p3 = _exact_marginals(pair[0], 1.0)
    assert min(_chi_square_p(tokens[:, 1], p2), _chi_square_p(tokens[:, 2], p3)) < 1e-6


def test_rejection_verify_output_is_p_for_any_q():
    """Unit check on synthetic distributions: first emitted token ~ p_0 whatever q_0 is."""
    g = torch.Generator().manual_seed(0)
    vocab, k, n = 6, 2, 20000
    p = torch.softmax(torch.randn(1, k + 1, vocab, generator=g), -1).expand(n, -1, -1)
    q = torch.softmax(2 * torch.randn(1, k, vocab, generator=g), -1).expand(n, -1, -1)
    drafts = draw(q, g)
    accepted, emitted = rejection_verify(drafts, q, p, torch.rand(n, k + 1, generator=g))
    assert 0 < accepted.float().mean() < k
    assert _chi_square_p(emitted[:, 0], p[0, 0]) > 1e-3


def _sample_with_threshold(pair, threshold):
    result = generate(TorchBackend(*pair, capacity=16), [PROMPT] * SAMPLES, max_new_tokens=3,
                      temperature=1.0, seed=1, confidence_threshold=threshold)
    proposed = {len(r["drafts"]) for r in result.trace if r["step"] > 0}
    return torch.tensor(result.token_ids), result.stats, proposed


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


def _wrong_rule_residual_at_the_limit(drafts, q, p, uniform, limit=None):
    """A bug the limit invites: cap the accepted count, but draw the token after the last proposed
    draft from the residual of the draft that was never proposed, instead of from p."""
    accepted, emitted = rejection_verify(drafts, q, p, uniform)
    capped = torch.minimum(accepted, limit)
    rows = torch.arange(len(drafts))
    residual = torch.cat([(p[:, :-1] - q).clamp_min(0), p[:, -1:]], 1)[rows, capped]
    cut = (capped == limit) & (limit < drafts.shape[1])
    emitted[rows, capped] = torch.where(cut, pick(residual, uniform[:, -1]), emitted[rows, capped])
    return capped, emitted


def test_a_wrong_rule_at_the_confidence_limit_is_detected(pair, monkeypatch):
    threshold = median_confidence(pair, [PROMPT] * 64, 3, 1.0)
    monkeypatch.setattr(runtime.decoding.step, "rejection_verify", _wrong_rule_residual_at_the_limit)
    tokens, _, _ = _sample_with_threshold(pair, threshold)
    p2, p3 = _exact_marginals(pair[0], 1.0)
    assert min(_chi_square_p(tokens[:, 1], p2), _chi_square_p(tokens[:, 2], p3)) < 1e-6


# costs at which this draft's acceptance is near break-even, so that adaptive caps vary step by step
NEAR_BREAK_EVEN = StepCosts(target=(1.0,) * 16, row=(0.1,) * 16, draft=(0.4,) * 16)


@pytest.mark.parametrize("adaptive", [False, True])
def test_sampling_through_the_scheduler_matches_target_distribution(pair, adaptive):
    """Continuous batching: half the samples, as requests of their own seeds through 16 slots,
    each slot refilled as soon as its request ends (which, with acceptance, varies), so requests
    join and leave mid-run beside others at every stage. (Each prompt is prefilled alone, which
    is what makes this test slower than the batch's.) Adaptive: each step's cap from the
    requests' acceptance so far, from none to all k, and the output still the target's
    distribution."""
    backend = TorchBackend(*pair, capacity=16, max_batch=16, max_prompt_chunk=8)
    policy = AdaptiveVerification(NEAR_BREAK_EVEN, pair[1].k) if adaptive else None
    scheduler = Scheduler(backend, eos_token_ids=(), draft_schedule=policy)
    requests = [scheduler.submit(PROMPT, Params(max_new_tokens=3, temperature=1.0, seed=i))
                for i in range(SAMPLES // 2)]
    scheduler.run()
    tokens = torch.tensor([r.token_ids for r in requests])
    stats = SpecStats(k=pair[1].k)
    for r in requests:
        stats.merge(r.stats)
    p2, p3 = _exact_marginals(pair[0], 1.0)
    assert 0.1 < stats.acceptance_per_position[0] < 0.9
    if adaptive:   # steps that verified none and steps that verified several
        assert stats.idle_steps > 100 and stats.verified > 2 * stats.steps
    assert _chi_square_p(tokens[:, 1], p2) > 1e-3
    assert _chi_square_p(tokens[:, 2], p3) > 1e-3
