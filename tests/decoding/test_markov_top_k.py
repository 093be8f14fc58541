"""``build --markov-top-k K``: each draft's Markov bias and choice over the K largest of its base
logits (vLLM's ``dspark_draft_topk``). Over every id it is DeepSpec's whole chain; over fewer, each
draft is one of its row's K largest and ``q`` is the distribution it was drawn from; an engine built
with it proposes what the reference module proposes, and its greedy output is the target's own."""
import pytest
import torch

import export.__main__ as cli
from modeling.pair import load_pair
from runtime.backends.ort import OrtBackend
from runtime.backends.pytorch import TorchBackend
from runtime.decoding.batch import generate

from conftest import LIMITS, MARKOV_TOP_K, PROMPTS, hf_greedy


def _inputs(draft, batch: int = 3, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    vocab = draft.config.draft_vocab_size
    base = 3 * torch.randn(batch, draft.k, vocab, generator=generator)
    anchor = torch.randint(draft.target_vocab_size, (batch,), generator=generator)
    uniform = torch.rand(batch, draft.k, draft.target_vocab_size, generator=generator)   # by target id
    gumbel = -torch.log(-torch.log(uniform))
    return base, anchor, torch.tensor([1.0, 0.7, 1.3])[:batch], gumbel


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_top_k_over_every_id_is_the_whole_chain(tiny, sampled):
    _, draft = load_pair(*tiny(**{k: v for k, v in MARKOV_TOP_K.items() if k != "markov_top_k"}))
    base, anchor, temperature, gumbel = _inputs(draft)
    noise = gumbel if sampled else torch.zeros_like(gumbel)
    tokens, q = draft.sample(base, anchor, temperature, noise)
    draft.markov_top_k = draft.config.draft_vocab_size
    tokens_k, q_k = draft.sample(base, anchor, temperature, noise)
    assert torch.equal(tokens_k, tokens)
    torch.testing.assert_close(q_k, q, rtol=1e-5, atol=1e-7)


def test_a_draft_is_one_of_its_rows_largest_base_logits_and_q_is_what_it_was_drawn_from(tiny):
    fields = {k: v for k, v in MARKOV_TOP_K.items() if k != "markov_top_k"}
    _, draft = load_pair(*tiny(**fields), markov_top_k=4)
    base, anchor, temperature, gumbel = _inputs(draft)
    tokens, q = draft.sample(base, anchor, temperature, gumbel)
    whole = draft.markov_top_k
    draft.markov_top_k = 0
    tokens_all, _ = draft.sample(base, anchor, temperature, gumbel)
    draft.markov_top_k = whole
    candidates = base.topk(4, dim=-1).indices + draft.d2t[base.topk(4, dim=-1).indices]   # as target ids
    assert (tokens[..., None] == candidates).any(-1).all()
    assert ((q > 0).sum(-1) == 4).all() and torch.allclose(q.sum(-1), torch.ones(q.shape[:2]))
    assert (q.gather(-1, candidates) > 0).all()
    assert not torch.equal(tokens, tokens_all)   # fewer candidates: other drafts here (the test can fail)


def test_an_engine_proposes_what_the_reference_proposes_and_keeps_the_greedy_invariant(engine_dir, tiny):
    engine = engine_dir(LIMITS, **MARKOV_TOP_K)
    backend, reference = OrtBackend(engine), TorchBackend.from_engine(engine)
    assert backend.manifest["draft"]["markov_top_k"] == reference.draft.markov_top_k == 6
    for temperature in (0.0, 1.0):
        result = generate(backend, PROMPTS, max_new_tokens=30, temperature=temperature, seed=5)
        expected = generate(reference, PROMPTS, max_new_tokens=30, temperature=temperature, seed=5)
        assert result.token_ids == expected.token_ids and result.trace == expected.trace
    greedy = generate(backend, PROMPTS, max_new_tokens=40, eos_token_ids=backend.limits.eos_token_ids)
    target_dir, _ = tiny(**{k: v for k, v in MARKOV_TOP_K.items() if k != "markov_top_k"})
    assert greedy.token_ids == hf_greedy(target_dir, PROMPTS, 40)
    assert greedy.stats.accepted_tokens > 0   # the drafts are not inert


@pytest.mark.parametrize("value, message", [("-1", r"--markov-top-k -1: expected 0 \(every draft id\) or a "
                                                     r"positive count"),
                                            ("31", r"--markov-top-k 31: expected 0 \(every draft id\) \.\. "
                                                   r"the draft vocabulary's 30 ids")])
def test_markov_top_k_outside_the_draft_vocabulary_is_one_line(tiny, tmp_path, value, message):
    target, draft = tiny(**{k: v for k, v in MARKOV_TOP_K.items() if k != "markov_top_k"})
    with pytest.raises(SystemExit, match=message):
        cli.main(["build", "--target", str(target), "--draft", str(draft), "--out", str(tmp_path / "e"),
                  "--markov-top-k", value, "--max-seq-len", "64", "--quiet"])
    assert not (tmp_path / "e").exists()
