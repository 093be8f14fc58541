"""Continuous batching (``runtime/decoding/batcher.py``): requests that join and leave a running pool get
exactly what they get alone, on ONNX Runtime (an engine's own slots) and on the PyTorch reference
(pooled: every decode step runs the whole pool, an empty or prefilling slot a frozen row)."""
from __future__ import annotations

import random

import pytest
import torch

from modeling.pair import load_pair
from runtime.backends.ort import OrtBackend
from runtime.backends.pytorch import TorchBackend
from runtime.decoding.batcher import Batcher
from runtime.decoding.draft_schedule import LoadSchedule, measure
from runtime.decoding.params import Params
from runtime.decoding.request import Status

from conftest import LIMITS, PROMPTS, hf_greedy

MAX_NEW = 30
# longer than a prefill chunk, and more of them than the pool has slots
REQUESTS = [*PROMPTS, [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42], [7, 9], [44, 45, 46, 47, 48, 49]]


def oracle(backend_class):
    """``backend_class`` whose draft proposes a random-length prefix of each slot's request's true
    greedy continuation (after running the real draft), so that every acceptance length is taken."""

    class SlotOracle(backend_class):
        def draft_step(self, ctx_aux, ctx_start, ctx_count, anchor, temperature, noise, slots=None):
            tokens, q = super().draft_step(ctx_aux, ctx_start, ctx_count, anchor, temperature, noise,
                                           slots=slots)
            tokens = tokens.clone()
            slots = range(len(anchor)) if slots is None else slots
            for b, (slot, pos) in enumerate(zip(slots, (ctx_start + ctx_count).tolist())):
                request = self.batcher.scheduler.slots[slot]
                if request is None or request.status is not Status.DECODING:   # a frozen row
                    continue
                truth = self.truth[tuple(request.prompt)][pos - len(request.prompt) + 1:]
                right = min(self.rng.randint(0, self.limits.k), len(truth))
                tokens[b, :right] = torch.tensor(truth[:right], dtype=torch.long)
            return tokens, q

    return SlotOracle


@pytest.fixture(scope="module")
def pair_dirs(tiny):
    return tiny(arch="qwen3")


@pytest.fixture(scope="module")
def truth(pair_dirs):
    return {"greedy": hf_greedy(pair_dirs[0], REQUESTS, MAX_NEW),
            "continuation": hf_greedy(pair_dirs[0], REQUESTS, MAX_NEW, eos=None)}


def _backend(kind, pair_dirs, engine_dir, oracle_drafts=False):
    if kind == "ort":
        cls = oracle(OrtBackend) if oracle_drafts else OrtBackend
        return cls(engine_dir(LIMITS, arch="qwen3"))
    cls = oracle(TorchBackend) if oracle_drafts else TorchBackend
    return cls(*load_pair(*pair_dirs), capacity=LIMITS.max_seq_len, max_batch=LIMITS.max_batch,
               max_prompt_chunk=LIMITS.max_prompt_chunk)


@pytest.mark.parametrize("kind", ["ort", "torch"])
def test_requests_joining_and_leaving_get_their_own_greedy_output(kind, pair_dirs, engine_dir, truth):
    """Six requests through four slots: submitted at different steps, each with its own
    ``max_new_tokens``, speculation on for most and off for two, one cancelled mid-run. Each
    gets the target's own greedy output (``transformers``'), and the drafts are really accepted."""
    backend = _backend(kind, pair_dirs, engine_dir, oracle_drafts=True)
    backend.truth = {tuple(p): c for p, c in zip(REQUESTS, truth["continuation"])}
    backend.rng = random.Random(0)
    batcher = backend.batcher = Batcher(backend)
    budgets = [MAX_NEW, 12, MAX_NEW, 7, MAX_NEW, 20]
    joins = [0, 0, 2, 3, 9, 9]                      # the step each request is submitted at
    requests, cancelled, step = {}, None, 0
    while len(requests) < len(REQUESTS) or batcher.busy:
        for i, at in enumerate(joins):
            if at == step:
                requests[i] = batcher.submit(REQUESTS[i], Params(max_new_tokens=budgets[i],
                                                                 speculative=i not in (1, 4)))
        if step == 6:   # a request in the middle of its decoding
            cancelled = requests[2]
            batcher.cancel(cancelled)
        batcher.step()
        step += 1
    assert cancelled.finish_reason == "cancelled" and 0 < len(cancelled.token_ids) < MAX_NEW
    for i, request in requests.items():
        expected = truth["greedy"][i][:budgets[i]]
        if request is not cancelled:
            assert request.token_ids == expected, f"request {i}"
            assert request.finish_reason == ("stop" if expected[-1] == 1 else "length")
        else:
            assert request.token_ids == expected[:len(request.token_ids)]
    accepted = [requests[i].stats for i in (0, 3, 5)]
    assert sum(s.accepted_tokens for s in accepted) > sum(s.steps for s in accepted)   # tau > 2
    assert requests[1].stats.accepted_tokens == requests[4].stats.accepted_tokens == 0


def test_the_draft_schedule_turns_drafts_off_while_slots_are_full(pair_dirs, engine_dir, truth):
    """``1:k,2:0``: a request drafts while alone, decodes target-only while two others share the
    pool, and drafts again once they leave; every output is still the target's greedy one."""
    backend = _backend("ort", pair_dirs, engine_dir, oracle_drafts=True)
    backend.truth = {tuple(p): c for p, c in zip(REQUESTS, truth["continuation"])}
    backend.rng = random.Random(1)
    k = backend.limits.k
    batcher = backend.batcher = Batcher(backend, eos_token_ids=(),
                                        draft_schedule=LoadSchedule.parse(f"1:{k},2:0", k))
    alone = batcher.submit(REQUESTS[0], Params(max_new_tokens=MAX_NEW))
    for _ in range(4):
        batcher.step()
    joined = [batcher.submit(REQUESTS[i], Params(max_new_tokens=8)) for i in (1, 4)]
    batcher.run()
    for request in (alone, *joined):
        i = REQUESTS.index(request.prompt)
        assert request.token_ids == truth["continuation"][i][:request.params.max_new_tokens]
    assert all(r.stats.steps == r.stats.verified == 0 for r in joined)
    stats = alone.stats
    assert stats.accepted_tokens > stats.steps > 0
    undrafted = MAX_NEW - 1 - stats.steps - stats.accepted_tokens
    assert undrafted >= 6, "target-only steps while the others decoded"


def test_drafts_after_target_only_steps_read_every_verified_row(pair_dirs, engine_dir):
    """At a cap of 0 the draft is called only when the verified rows fill a call; the drafts it
    then proposes (discarded) are those of a run that drafted at every step, position by
    position: no row of context was lost or doubled."""
    class Recording(OrtBackend):
        def draft_step(self, ctx_aux, ctx_start, ctx_count, anchor, temperature, noise, slots=None):
            tokens, q = super().draft_step(ctx_aux, ctx_start, ctx_count, anchor, temperature, noise,
                                           slots=slots)
            self.drafts[int(ctx_start[0] + ctx_count[0])] = tokens[0].tolist()
            return tokens, q

    prompt = REQUESTS[3]
    runs = {}
    for schedule in ("1:0", None):
        backend = Recording(engine_dir(LIMITS, arch="qwen3"))
        backend.drafts = {}
        batcher = Batcher(backend, eos_token_ids=(), confidence_threshold=0,
                          draft_schedule=schedule and LoadSchedule.parse(schedule, backend.limits.k))
        request = batcher.submit(prompt, Params(max_new_tokens=MAX_NEW))
        batcher.run()
        decoding = {p: d for p, d in backend.drafts.items() if p > len(prompt)}
        runs[schedule] = request.token_ids, decoding
    (capped_ids, capped), (full_ids, full) = runs["1:0"], runs[None]
    assert capped_ids == full_ids
    assert 3 <= len(capped) < MAX_NEW // 2, "the draft called only when a call's rows are full"
    assert set(capped) <= set(full), "the random draft is rarely accepted: every position is an anchor"
    assert {p: full[p] for p in capped} == capped


def test_a_measured_schedule_plans_with_this_backend_and_leaves_it_clean(pair_dirs, engine_dir, truth):
    """``measure`` times every batch size; a batcher on the same backend afterwards (its caches
    full of the timing calls' junk) still gives the target's greedy output."""
    backend = _backend("ort", pair_dirs, engine_dir)
    limits = backend.limits
    schedule, costs = measure(backend, repeats=1)
    assert len(costs.target_one) == len(costs.target_full) == limits.max_batch
    assert min(costs.target_one + costs.target_full) > 0
    assert schedule.steps[0] == (1, limits.k) and all(0 <= d <= limits.k for _, d in schedule.steps)
    batcher = Batcher(backend, draft_schedule=schedule)
    requests = [batcher.submit(p, Params(max_new_tokens=MAX_NEW)) for p in REQUESTS[:4]]
    batcher.run()
    assert [r.token_ids for r in requests] == truth["greedy"][:4]


def test_a_seeded_request_samples_the_same_alone_and_among_others(pair_dirs, engine_dir):
    """ONNX Runtime computes each slot on its own and each request's noise is its seed's by
    position: a sampled request's tokens do not depend on what else runs (nor on the cap that the
    load sets), and another seed changes them."""
    backend = _backend("ort", pair_dirs, engine_dir)
    sampled = Params(max_new_tokens=MAX_NEW, temperature=1.0, top_p=0.9, seed=7)

    def run(seed, neighbours):
        batcher = Batcher(backend)
        others = [batcher.submit(p, Params(max_new_tokens=MAX_NEW, temperature=0.7, seed=i))
                  for i, p in enumerate(REQUESTS[:neighbours])]
        batcher.step()
        mine = batcher.submit(REQUESTS[3], Params(**{**vars(sampled), "seed": seed}))
        batcher.run()
        assert all(o.finished for o in others)
        return mine.token_ids

    alone = run(7, 0)
    assert run(7, 4) == alone
    assert run(8, 0) != alone


def test_a_request_that_cannot_fit_is_refused_by_name(pair_dirs, engine_dir):
    batcher = Batcher(_backend("ort", pair_dirs, engine_dir))
    with pytest.raises(ValueError, match=r"request 3 has 90 tokens: .* capacity is 96"):
        batcher.submit(list(range(5, 95)), Params(max_new_tokens=8), name="request 3")
    with pytest.raises(ValueError, match="max_new_tokens 0: expected at least 1"):
        batcher.submit([5, 6], Params(max_new_tokens=0))
    assert not batcher.busy


def test_a_hybrid_target_keeps_a_prefilling_slots_state_in_pooled_steps(tiny):
    """The PyTorch backend steps the whole pool: while a long prompt is prefilled chunk by chunk
    into one slot, the other slot decodes, and the prefilling slot's row in those steps is frozen
    (its recurrent state kept where it is). A request that reuses a slot starts from a clear state,
    not from where the last one left it (a short prompt: what it would inherit has not decayed)."""
    target_dir, draft_dir = tiny(arch="qwen3_5")
    prompts = [REQUESTS[0], REQUESTS[3], REQUESTS[4]]   # 7, 13 (two chunks) and 2 tokens
    expected = hf_greedy(target_dir, prompts, 12)
    backend = TorchBackend(*load_pair(target_dir, draft_dir), capacity=LIMITS.max_seq_len, max_batch=2,
                           max_prompt_chunk=LIMITS.max_prompt_chunk)
    batcher = Batcher(backend)
    requests = [batcher.submit(prompts[0], Params(max_new_tokens=12))]
    batcher.step()
    batcher.step()
    requests += [batcher.submit(p, Params(max_new_tokens=12)) for p in prompts[1:]]
    batcher.run()
    assert [r.token_ids for r in requests] == expected


@pytest.mark.parametrize("kind", ["ort", "torch"])
def test_a_prompt_that_extends_a_free_slots_sequence_prefills_only_the_rest(kind, pair_dirs, engine_dir):
    """A conversation's second turn (the first turn's prompt and answer, then more) goes to the
    slot the first turn left and prefills only what follows its sequence; its tokens and the drafts
    each step verified are those of the same prompt in a fresh pool, and the target's greedy ones.
    A prompt that shares nothing takes the other slot, cleared."""
    def turns(batcher):
        first = batcher.submit(REQUESTS[3], Params(max_new_tokens=12))
        batcher.run()
        other = batcher.submit(REQUESTS[1], Params(max_new_tokens=5))
        second = batcher.submit(REQUESTS[3] + first.token_ids + [50, 51, 52], Params(max_new_tokens=15))
        batcher.run()
        return first, other, second

    first, other, second = turns(Batcher(_backend(kind, pair_dirs, engine_dir), eos_token_ids=(), pool=2))
    assert second.slot == first.slot != other.slot and other.reused == 0
    assert second.reused == len(REQUESTS[3]) + len(first.token_ids) - 1   # all but the anchor's row
    fresh = Batcher(_backend(kind, pair_dirs, engine_dir), eos_token_ids=(), pool=2)
    alone = fresh.submit(second.prompt, Params(max_new_tokens=15))
    fresh.run()
    assert alone.reused == 0
    assert second.token_ids == alone.token_ids == hf_greedy(pair_dirs[0], [second.prompt], 15, eos=None)[0]
    assert [t["drafts"] for t in second.trace] == [t["drafts"] for t in alone.trace]
    assert sum(len(t["drafts"]) for t in second.trace) > 0


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma4"])
def test_a_target_that_cannot_go_back_reuses_a_whole_sequence_or_nothing(tiny, arch):
    """A hybrid's recurrent state holds only the state after its last row, a sliding layer's ring
    only its last rows: a prompt that extends a free slot's whole sequence prefills the rest there
    (from the kept state, over prefill chunks shorter than it) and gets ``transformers``' greedy
    tokens; one that leaves that sequence earlier shares nothing and takes a cleared slot."""
    target_dir, draft_dir = tiny(arch=arch)
    backend = TorchBackend(*load_pair(target_dir, draft_dir), capacity=96, max_batch=2, max_prompt_chunk=5)
    batcher = Batcher(backend, eos_token_ids=(), pool=2)
    alone = Params(max_new_tokens=10, speculative=False)
    first = batcher.submit(REQUESTS[3], alone)
    batcher.run()
    extended = REQUESTS[3] + first.token_ids + [50, 51, 52, 53, 54, 55, 56]
    left_early = REQUESTS[3][:6] + [60, 61]
    second = batcher.submit(extended, alone)
    batcher.run()
    third = batcher.submit(left_early, alone)
    batcher.run()
    assert second.slot == first.slot and second.reused == len(REQUESTS[3]) + len(first.token_ids) - 1
    assert third.reused == 0
    expected = hf_greedy(target_dir, [extended, left_early], 10, eos=None)
    assert [second.token_ids, third.token_ids] == expected
