"""The invariant: greedy speculative output == the target's own greedy output (``transformers``
``generate``), token for token, on every path: both architectures, both draft formats, reduced
vocabulary, both layouts, fewer drafts than trained, batch 1 and ragged batch 3."""

import pytest
import torch

from modeling.draft_config import BONUS_ANCHOR
from modeling.pair import load_pair
from runtime.backends.base import capacity_needed
from runtime.backends.pytorch import TorchBackend
from runtime.decoding.batch import generate

from conftest import PROMPTS, hf_greedy, median_confidence
from oracles import OracleDrafts

MAX_NEW = 40

CASES = {
    "qwen3-native": dict(arch="qwen3"),
    "llama-speculators": dict(arch="llama", draft_format="speculators"),
    "qwen3-native-reduced-vocab": dict(arch="qwen3", draft_vocab=40),
    "llama-speculators-reduced-bonus-anchor": dict(arch="llama", draft_format="speculators",
                                                    draft_vocab=30, layout=BONUS_ANCHOR),
    "qwen3-native-bonus-anchor": dict(arch="qwen3", layout=BONUS_ANCHOR, block_size=5),
}


@pytest.fixture(scope="module")
def expected(tiny):
    """``transformers`` greedy continuations per target architecture (EOS id 1 stops them)."""
    outputs = {arch: hf_greedy(tiny(arch=arch)[0], PROMPTS, MAX_NEW) for arch in ("qwen3", "llama")}
    # the Llama batch stops at three different points (EOS), so ragged stopping is covered
    assert len({len(ids) for ids in outputs["llama"]}) == 3
    return outputs


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_greedy_equals_transformers(tiny, expected, case, batch):
    target, draft = load_pair(*tiny(**CASES[case]))
    backend = TorchBackend(target, draft, capacity=96)
    prompts = PROMPTS[:batch]
    result = generate(backend, prompts, max_new_tokens=MAX_NEW,
                      eos_token_ids=target.config.eos_token_ids)
    assert result.token_ids == expected[CASES[case]["arch"]][:batch]


def test_fewer_drafts_than_trained(tiny, expected):
    target, draft = load_pair(*tiny(arch="qwen3"), k=2)
    assert draft.k == 2 < draft.config.max_drafts
    result = generate(TorchBackend(target, draft, capacity=96), PROMPTS, max_new_tokens=MAX_NEW,
                      eos_token_ids=target.config.eos_token_ids)
    assert result.token_ids == expected["qwen3"]
    assert all(len(r["drafts"]) == 2 for r in result.trace if r["step"] > 0)


def test_target_only_decoding(tiny, expected):
    target, _ = load_pair(*tiny(arch="llama"))
    result = generate(TorchBackend(target, None, capacity=96), PROMPTS, max_new_tokens=MAX_NEW,
                      eos_token_ids=target.config.eos_token_ids)
    assert result.token_ids == expected["llama"]


@pytest.mark.slow
def test_confidence_threshold_keeps_greedy_output(tiny, expected):
    """Drafts cut at the first unconfident one (about half, at the median confidence; or all, at
    1.0) change what is verified, never what is generated."""
    pair = load_pair(*tiny(arch="qwen3"))
    median = median_confidence(pair, PROMPTS, MAX_NEW, temperature=1.0)
    for threshold, counts in ((median, None), (1.0, {0})):
        result = generate(TorchBackend(*pair, capacity=96), PROMPTS, max_new_tokens=MAX_NEW,
                          eos_token_ids=pair[0].config.eos_token_ids, confidence_threshold=threshold)
        assert result.token_ids == expected["qwen3"]
        proposed = {len(r["drafts"]) for r in result.trace if r["step"] > 0}
        assert proposed == counts if counts else len(proposed) > 2


def test_every_acceptance_length_with_oracle_drafts(tiny):
    target_dir, draft_dir = tiny(arch="qwen3", draft_vocab=40)
    continuations = hf_greedy(target_dir, PROMPTS, MAX_NEW, eos=None)
    target, draft = load_pair(target_dir, draft_dir)
    backend = OracleDrafts(target, draft, PROMPTS, continuations)
    result = generate(backend, PROMPTS, max_new_tokens=MAX_NEW)
    assert result.token_ids == continuations
    accepted = {r["accepted"] for r in result.trace if r["step"] > 0}
    assert accepted == set(range(draft.k + 1))
    assert result.stats.tau > 2.0
    # the trace's emitted tokens concatenate to the output
    for b in range(len(PROMPTS)):
        emitted = [t for r in result.trace if r["sequence"] == b for t in r["emitted"]]
        assert emitted == result.token_ids[b]


class GreedyFirstSequence(OracleDrafts):
    """Every draft of sequence 0 is right, no draft of the others is: sequence 0 finishes many
    steps before them, on a step that accepts all ``k`` drafts."""

    def draft_step(self, ctx_aux, ctx_start, ctx_count, anchor, temperature, noise, slots=None):
        self.rng.randint = lambda low, high: high
        tokens, q = super().draft_step(ctx_aux, ctx_start, ctx_count, anchor, temperature, noise, slots)
        tokens[1:] = self.limits.vocab_size - 1 - tokens[1:]      # wrong (the tiny targets never emit it)
        return tokens, q


@pytest.mark.slow
def test_capacity_is_enough_when_sequences_finish_apart(tiny):
    """The capacity ``generate`` asks for (prompt + max_new_tokens + lookahead) holds every step of
    a ragged batch: a sequence that finishes early stays frozen where it stopped while the others go
    on, rather than moving past its budget and writing beyond the end of its caches."""
    target_dir, draft_dir = tiny(arch="qwen3")
    target, draft = load_pair(target_dir, draft_dir)
    # the first token, then steps of k + 1 tokens, leave sequence 0 one short of its budget; its
    # last step accepts all k drafts, of which only one is kept
    max_new = 2 + 9 * (draft.k + 1)
    prompts = [PROMPTS[2], PROMPTS[0]]                    # the longest prompt finishes first
    continuations = hf_greedy(target_dir, prompts, max_new + draft.k, eos=None)  # the oracle's truth
    capacity = capacity_needed(len(prompts[0]), max_new, k=draft.k, block_size=draft.config.block_size)
    backend = GreedyFirstSequence(target, draft, prompts, continuations, capacity=capacity)
    result = generate(backend, prompts, max_new_tokens=max_new)
    assert result.token_ids == [c[:max_new] for c in continuations]
    assert [r["accepted"] for r in result.trace if r["sequence"] == 0][-1] == draft.k
    last_step = [max(r["step"] for r in result.trace if r["sequence"] == b) for b in range(2)]
    assert last_step[0] < last_step[1]


def test_repetition_penalty_greedy_equals_transformers(tiny):
    """Each verify row penalized for the drafts before it: speculative output (drafts accepted
    by an oracle, so rows carry drafts) equals transformers' greedy output with the same
    ``repetition_penalty``, which differs from the unpenalized output."""
    target_dir, draft_dir = tiny(arch="qwen3", draft_vocab=40)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    expected = [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                               pad_token_id=0, repetition_penalty=1.5)[0, len(p):].tolist() for p in PROMPTS]
    target, draft = load_pair(target_dir, draft_dir)
    assert expected != hf_greedy(target_dir, PROMPTS, MAX_NEW, eos=None)
    result = generate(OracleDrafts(target, draft, PROMPTS, expected), PROMPTS, max_new_tokens=MAX_NEW,
                      repetition_penalty=1.5)
    assert result.token_ids == expected
    assert sum(r["accepted"] for r in result.trace) > 20
    target_only = generate(TorchBackend(target, None, capacity=96), PROMPTS, max_new_tokens=MAX_NEW,
                           repetition_penalty=1.5)
    assert target_only.token_ids == expected


def test_presence_and_frequency_penalties_greedy_equal_target_only(tiny):
    """OpenAI's penalties on generated tokens (a token's logit less ``frequency_penalty`` times its
    count and ``presence_penalty`` once it appeared), each verify row also for the drafts before
    it: speculative output (oracle drafts, so rows carry drafts) equals target-only output with the
    same penalties, which differs from the unpenalized output."""
    from runtime.decoding.batcher import Batcher
    from runtime.decoding.params import Params
    from runtime.decoding.penalties import Penalties

    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    penalties = Penalties(1.0, 0.5, 0.25, [3], 4, torch.device("cpu"))
    penalties.record([1, 1, 2])
    assert penalties(logits).tolist() == [[1.0, 2.0 - 0.5 - 0.5, -1.0 - 0.25 - 0.5, 0.5]]
    target_dir, draft_dir = tiny(arch="qwen3", draft_vocab=40)
    target, draft = load_pair(target_dir, draft_dir)

    def run(backend, **penalty):
        batcher = Batcher(backend, eos_token_ids=(), pool=len(PROMPTS))
        requests = [batcher.submit(p, Params(max_new_tokens=MAX_NEW, **penalty)) for p in PROMPTS]
        batcher.run()
        return [r.token_ids for r in requests], sum(t["accepted"] for r in requests for t in r.trace)

    penalty = dict(presence_penalty=1.5, frequency_penalty=0.5)
    expected, _ = run(TorchBackend(target, None, capacity=96), **penalty)
    assert expected != run(TorchBackend(target, None, capacity=96))[0]
    speculative, accepted = run(OracleDrafts(target, draft, PROMPTS, expected), **penalty)
    assert speculative == expected and accepted > 20
