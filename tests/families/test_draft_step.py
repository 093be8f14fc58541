"""DSpark draft semantics (``docs/dspark.md``: the block backbone, the Markov head), checked
against explicit recomputations."""
import pytest
import torch

from modeling.draft_config import ANCHOR_FIRST, BONUS_ANCHOR
from modeling.pair import load_pair
from plugins.block_attention import block_attention
from plugins.d2t_gather import d2t_gather


def _context(target, prompts):
    """Prefill the target; return padded aux rows and per-row lengths."""
    lengths = torch.tensor([len(p) for p in prompts])
    padded = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = torch.tensor(p)
    _, aux, *_ = target(padded, torch.zeros(len(prompts), dtype=torch.long),
                          torch.zeros(len(prompts), 1, dtype=torch.long),
                          *target.empty_cache(len(prompts), 64))
    return aux, lengths


def _run(draft, aux, lengths, anchor, noise=None, temperature=None):
    batch = aux.shape[0]
    noise = torch.zeros(batch, draft.k, draft.target_vocab_size) if noise is None else noise
    temperature = torch.ones(batch) if temperature is None else temperature
    tokens, q, *_ = draft(aux, torch.zeros(batch, dtype=torch.long), lengths, anchor, temperature,
                          noise, *draft.empty_cache(batch, 64))
    return tokens, q


def _base_logits(draft, aux, lengths, anchor):
    cache = draft.write_context(aux, torch.zeros(len(lengths), dtype=torch.long),
                                *draft.empty_cache(len(lengths), 64))
    return draft.block_logits(anchor, lengths, *cache)[0]


def _markov_by_hand(draft, base, anchor, predecessor_is_target_id=True):
    """The sampler written out: prev_0 = anchor, prev_i = the *target* id emitted at row i-1."""
    w1, w2, d2t = draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight, draft.d2t
    first = draft.config.first_draft_row
    prev, out = anchor, []
    for i in range(draft.k):
        chosen = (base[:, first + i] + w1[prev] @ w2.T).argmax(-1)
        token = chosen + d2t[chosen]
        out.append(token)
        prev = token if predecessor_is_target_id else chosen
    return torch.stack(out, 1)


@pytest.fixture(scope="module", params=[(None, ANCHOR_FIRST), (40, ANCHOR_FIRST), (40, BONUS_ANCHOR)],
                ids=["full-vocab", "reduced-vocab", "reduced-bonus-anchor"])
def loaded(request, tiny):
    vocab, layout = request.param
    target, draft = load_pair(*tiny(draft_vocab=vocab, layout=layout))
    # a strong Markov head, so a wrong predecessor visibly changes the drafts
    draft.markov_head.markov_w1.weight.mul_(4.0)
    return target, draft


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18, 19, 20, 21]]
ANCHORS = torch.tensor([22, 23, 24])


def test_markov_chain_predecessors_are_anchor_then_emitted_target_ids(loaded):
    target, draft = loaded
    aux, lengths = _context(target, PROMPTS)
    tokens, _ = _run(draft, aux, lengths, ANCHORS)
    base = _base_logits(draft, aux, lengths, ANCHORS)
    assert torch.equal(tokens, _markov_by_hand(draft, base, ANCHORS))
    if draft.config.draft_vocab_size < draft.target_vocab_size:
        # feeding draft-vocab ids back instead (spec pitfall 7) gives different drafts
        assert not torch.equal(tokens, _markov_by_hand(draft, base, ANCHORS, predecessor_is_target_id=False))


def test_drafts_are_target_ids_through_d2t_offsets(loaded):
    _, draft = loaded
    allowed = set((torch.arange(draft.config.draft_vocab_size) + draft.d2t).tolist())
    aux = torch.randn(3, 8, draft.fc.in_features)
    tokens, q = _run(draft, aux, torch.tensor([8, 5, 2]), ANCHORS)
    assert set(tokens.flatten().tolist()) <= allowed
    # q is a distribution over the target vocabulary with no mass outside the mapped ids
    assert torch.allclose(q.sum(-1), torch.ones(q.shape[:2]))
    outside = torch.ones(draft.target_vocab_size, dtype=torch.bool)
    outside[list(allowed)] = False
    assert q[..., outside].abs().sum() == 0


def test_a_draft_id_takes_the_noise_of_its_target_id(loaded):
    """The noise is over the target's ids (a position's noise is the target's and the draft's,
    ``runtime/decoding/noise.py``): a draft id's comes from its target id, whatever the draft's
    vocabulary, so that a large value there makes that id the draft, and one on a target id the
    draft cannot propose changes nothing."""
    _, draft = loaded
    aux = torch.randn(3, 8, draft.fc.in_features, generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([8, 5, 2])
    plain, _ = _run(draft, aux, lengths, ANCHORS)
    draft_id = draft.config.draft_vocab_size - 2
    target_id = int(draft_id + draft.d2t[draft_id])
    noise = torch.zeros(3, draft.k, draft.target_vocab_size)
    noise[:, 0, target_id] = 1e4
    tokens, _ = _run(draft, aux, lengths, ANCHORS, noise=noise)
    assert tokens[:, 0].tolist() == [target_id] * 3 and not torch.equal(plain[:, 0], tokens[:, 0])
    unused = sorted(set(range(draft.target_vocab_size))
                    - set((torch.arange(draft.config.draft_vocab_size) + draft.d2t).tolist()))
    if unused:
        noise = torch.zeros(3, draft.k, draft.target_vocab_size)
        noise[:, :, unused] = 1e4
        assert torch.equal(_run(draft, aux, lengths, ANCHORS, noise=noise)[0], plain)


def test_d2t_gather_maps_by_offset():
    scores = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    d2t = torch.tensor([10, 20, 30])
    w1 = torch.arange(60.0).reshape(60, 1)
    ids, rows = d2t_gather(scores, d2t, w1)
    assert ids.tolist() == [1 + 20, 0 + 10]
    assert rows[:, 0].tolist() == [21.0, 10.0]


def test_layout_selects_block_rows(tiny):
    """Same weights, two layouts: anchor-first drafts from block rows 0..k-1, bonus-anchor from
    rows 1..k; both with the anchor as the first Markov predecessor."""
    target, first = load_pair(*tiny(layout=ANCHOR_FIRST), k=3)
    _, bonus = load_pair(*tiny(layout=ANCHOR_FIRST), k=3)
    bonus.config = bonus.config.__class__(**{**bonus.config.__dict__, "layout": BONUS_ANCHOR})
    aux, lengths = _context(target, PROMPTS)
    base = _base_logits(first, aux, lengths, ANCHORS)
    assert torch.equal(base, _base_logits(bonus, aux, lengths, ANCHORS))
    assert torch.equal(_run(first, aux, lengths, ANCHORS)[0], _markov_by_hand(first, base, ANCHORS))
    assert torch.equal(_run(bonus, aux, lengths, ANCHORS)[0], _markov_by_hand(bonus, base, ANCHORS))
    assert bonus.config.max_drafts == first.config.max_drafts - 1


def test_block_positions_follow_the_anchor(loaded):
    """The block sits at p_anchor = ctx_start + ctx_count: moving the anchor one row later (one
    more context row) must change the result, while padding rows past ctx_count must not."""
    target, draft = loaded
    aux, lengths = _context(target, PROMPTS)
    tokens, q = _run(draft, aux, lengths, ANCHORS)
    junk = torch.cat([aux, 100 * torch.randn(3, 4, aux.shape[-1])], dim=1)
    tokens_padded, q_padded = _run(draft, junk, lengths, ANCHORS)
    assert torch.equal(tokens, tokens_padded) and torch.allclose(q, q_padded, atol=1e-6)
    _, q_shifted = _run(draft, junk, lengths + 1, ANCHORS)
    assert not torch.allclose(q, q_shifted, atol=1e-3)


def test_block_is_non_causal(loaded):
    """Row 0 holds the anchor; it only changes with the MASK slots after it if attention inside
    the block is non-causal."""
    target, draft = loaded
    aux, lengths = _context(target, PROMPTS)
    base = _base_logits(draft, aux, lengths, ANCHORS)
    original = draft.config.mask_token_id
    draft.config = draft.config.__class__(**{**draft.config.__dict__, "mask_token_id": original + 20})
    try:
        changed = _base_logits(draft, aux, lengths, ANCHORS)
    finally:
        draft.config = draft.config.__class__(**{**draft.config.__dict__, "mask_token_id": original})
    assert (base[:, 0] - changed[:, 0]).abs().max() > 1e-3


def test_block_attention_modes():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    cache = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    start = torch.tensor([5, 9])
    k2 = k.clone()
    k2[:, :, 2] += 1.0  # change the last block row only
    for causal in (True, False):
        out, kc, _ = block_attention(q, k, v, *cache, start, causal=causal, scale=0.35)
        out2, _, _ = block_attention(q, k2, v, *cache, start, causal=causal, scale=0.35)
        earlier_rows_changed = (out[:, :, :2] - out2[:, :, :2]).abs().max() > 1e-4
        assert earlier_rows_changed == (not causal)
        for b in range(2):  # written in place at each row's own start
            assert torch.equal(kc[b, :, start[b]:start[b] + 3], k[b])
            assert torch.equal(kc[b, :, :start[b]], cache[0][b, :, :start[b]])
