"""Speculative sampling reproduces the target's distribution (fixed seeds: deterministic)."""
import pytest
import torch
from scipy.stats import chisquare

import runtime.speculative
from export.onnx_export import Limits
from export.pair import load_pair
from runtime.ort_backend import OrtBackend
from runtime.sampling import draw, probabilities
from runtime.speculative import generate
from runtime.torch_backend import TorchBackend
from runtime.verify import rejection_verify

PROMPT = [5, 6, 7, 8, 9, 10]
SAMPLES = 4000


def _chi_square_p(samples: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of ``samples`` (ids) against the distribution ``expected``, pooling rare ids."""
    observed = torch.bincount(samples, minlength=len(expected)).double()
    counts = expected.double() * len(samples)
    common = counts >= 5
    obs, exp = observed[common], counts[common]
    if not common.all():
        obs = torch.cat([obs, observed[~common].sum()[None]])
        exp = torch.cat([exp, counts[~common].sum()[None]])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def _exact_marginals(target, temperature):
    """Exact distributions of generated tokens 2 and 3 under the target alone."""
    def next_probs(prefixes):
        ids = torch.tensor(prefixes)
        logits, *_ = target(ids, torch.zeros(len(ids), dtype=torch.long),
                            *target.empty_cache(len(ids), ids.shape[1]))
        return probabilities(logits[:, -1], temperature)

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


def _sample(pair, temperature, backend=None):
    backend = backend or TorchBackend(*pair, capacity=16)
    result = generate(backend, [PROMPT] * SAMPLES, max_new_tokens=3, temperature=temperature, seed=1)
    tokens = torch.tensor(result.token_ids)
    return tokens, result.stats


def _wrong_rule_resample_from_p(drafts, q, p, generator):
    """A classic bug: on rejection, draw from p instead of the residual max(p - q, 0)."""
    accepted, emitted = rejection_verify(drafts, q, p, generator)
    rows = torch.arange(len(drafts))
    emitted[rows, accepted] = draw(p[rows, accepted], generator)
    return accepted, emitted


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculative_sampling_matches_target_distribution(pair, temperature):
    tokens, stats = _sample(pair, temperature)
    p2, p3 = _exact_marginals(pair[0], temperature)
    # both acceptance and rejection happen, so both branches are under test
    assert 0.1 < stats.acceptance_per_position[0] < 0.9
    assert _chi_square_p(tokens[:, 1], p2) > 1e-3
    assert _chi_square_p(tokens[:, 2], p3) > 1e-3


def test_onnx_runtime_sampling_matches_target_distribution(pair, ort_backend):
    """The same check through the exported graphs: Gumbel-max drafts inside the draft graph,
    rejection sampling on the host."""
    tokens, stats = _sample(pair, 1.0, ort_backend)
    p2, p3 = _exact_marginals(pair[0], 1.0)
    assert 0.1 < stats.acceptance_per_position[0] < 0.9
    assert _chi_square_p(tokens[:, 1], p2) > 1e-3
    assert _chi_square_p(tokens[:, 2], p3) > 1e-3


def test_a_wrong_acceptance_rule_is_detected(pair, monkeypatch):
    monkeypatch.setattr(runtime.speculative, "rejection_verify", _wrong_rule_resample_from_p)
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
    accepted, emitted = rejection_verify(drafts, q, p, g)
    assert 0 < accepted.float().mean() < k
    assert _chi_square_p(emitted[:, 0], p[0, 0]) > 1e-3
