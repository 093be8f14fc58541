"""The scheduler's decisions without a model (``runtime/decoding/scheduler.py``): each test plans
steps, writes what a backend would have returned by hand, and checks what the scheduler makes
of it: admission, chunked prefill, pooled rows, prefix reuse, stops, cancellation and the draft
schedule's cap (vLLM's ``tests/v1/core/test_scheduler.py``). That what it plans runs exactly
on real engines is ``test_batcher.py``'s."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from runtime.backends.base import BackendLimits
from runtime.decoding.draft_schedule import LoadSchedule
from runtime.decoding.plan import Decoded, Outcome, Plan, Prefilled
from runtime.decoding.prefix_cache import Held
from runtime.decoding.request import DraftContext, Request, Status
from runtime.decoding.scheduler import Params, Scheduler
from runtime.decoding.step import Verdict

EOS = 2
TAPS = 8       # the width of a target tap row
LIMITS = BackendLimits(vocab_size=64, k=3, block_size=4, capacity=64, max_batch=4, max_prompt_chunk=4,
                       eos_token_ids=(EOS,), confidence_threshold=0.0)
SHORT = Params(max_new_tokens=8)


def scheduler(pool: int = 2, pooled: bool = False, limits: BackendLimits = LIMITS, **options) -> Scheduler:
    return Scheduler(limits, pooled=pooled, pool=pool, **options)


def outcome(plan: Plan, emitted: dict[int, list[int]] | None = None, first: int = 40) -> Outcome:
    """What a backend would give ``plan``: request ``id`` of a decode row emits ``emitted[id]``
    (its drafts all accepted but the last token; default: one token, ``first`` + its id), and a
    prompt's last chunk samples ``first`` + its id; tap rows hold the position they are at."""
    emitted = emitted or {}
    decoded = []
    for call in plan.calls:
        rows = {}
        for b in call.live:
            request = call.requests[b]
            tokens = emitted.get(request.id, [first + request.id])
            accepted, position = len(tokens) - 1, request.anchor_pos
            taps = torch.arange(position, position + accepted + 1.0)[:, None].expand(-1, TAPS)
            rows[b] = Decoded(Verdict(accepted, accepted, tokens, tokens[:-1]), taps, None)
        decoded.append(rows)
    prefilled = []
    for chunk in plan.chunks:
        requests = chunk.group.requests
        done = Prefilled([[] for _ in requests])
        if chunk.last:     # the context rows of the last chunk (none where a prompt ended before it)
            begin, rows = chunk.group.done, LIMITS.max_prompt_chunk
            done.tokens = [first + r.id for r in requests]
            lengths = [len(r.prompt) - r.reused for r in requests]
            done.contexts = [DraftContext(torch.zeros(min(max(n - begin, 0), rows), TAPS),
                                          r.reused + min(n, begin)) for r, n in zip(requests, lengths)]
        prefilled.append(done)
    return Outcome(decoded, prefilled)


def step(s: Scheduler, emitted: dict[int, list[int]] | None = None) -> tuple[Plan, list[Request]]:
    """Plan a step and apply its ``outcome`` (which moves the plan's groups on: read a group's
    ``done`` before, with ``schedule`` and ``update`` apart)."""
    plan = s.schedule()
    return plan, s.update(plan, outcome(plan, emitted))


def test_requests_wait_for_a_free_slot_and_prefill_a_chunk_a_step():
    s = scheduler(pool=2)
    long, short, queued = (s.submit(list(range(5, 5 + n)), Params(max_new_tokens=4)) for n in (10, 3, 2))
    plan, changed = step(s)
    assert [(a.request, a.slot, a.clear) for a in plan.admitted] == [(long, 0, True), (short, 1, True)]
    assert plan.calls == [] and [(c.group.requests, c.last, c.slots) for c in plan.chunks] == \
        [([long], False, [0]), ([short], True, [1])]
    assert changed == [short] and short.token_ids == [41] and short.status is Status.DECODING
    assert long.status is Status.PREFILLING and long.anchor_pos == 4 and queued.status is Status.WAITING
    assert short.context.start == 0 and short.context.count == 3 and short.anchor_pos == 3

    plan = s.schedule()           # the short one decodes while the long one goes on prefilling
    assert [call.requests for call in plan.calls] == [[short]] and plan.calls[0].slots == [1]
    assert plan.calls[0].anchor == [41] and plan.calls[0].anchor_pos == [3]
    assert [(c.group.done, c.last) for c in plan.chunks] == [(4, False)]
    s.update(plan, outcome(plan))
    assert long.anchor_pos == 8 and short.token_ids == [41, 41]
    plan = s.schedule()
    assert [(c.group.done, c.last) for c in plan.chunks] == [(8, True)]
    changed = s.update(plan, outcome(plan))
    assert changed == [short, long] and long.token_ids == [40] and long.anchor_pos == 10
    assert queued.status is Status.WAITING and s.occupied == 2


def test_speculative_and_target_only_requests_decode_in_calls_of_their_own():
    s = scheduler(pool=3)
    drafting = s.submit([5, 6, 7], SHORT)
    plain = s.submit([8, 9], replace(SHORT, speculative=False))
    step(s)
    plan, changed = step(s, {drafting.id: [20, 21, 22]})
    speculative, target_only = plan.calls
    assert speculative.requests == [drafting] and speculative.cap == 3 and speculative.drafting
    assert target_only.requests == [plain] and target_only.cap == 0 and not target_only.drafting
    assert changed == [drafting, plain]
    assert drafting.token_ids == [40, 20, 21, 22] and plain.token_ids == [41, 41]
    # the verified rows are the draft's next context, from the anchor's position on
    assert drafting.anchor_pos == 6 and drafting.context.start == 3 and drafting.context.count == 3
    assert drafting.stats.steps == 1 and drafting.stats.accepted_tokens == 2 and drafting.state_slot == 2
    assert drafting.trace[-1] == {"step": 1, "anchor": 40, "drafts": [20, 21], "accepted": 2,
                                  "emitted": [20, 21, 22]}


def test_a_pooled_step_runs_every_slot_and_requests_admitted_together_prefill_together():
    s = scheduler(pool=4, pooled=True)
    first, second = s.submit([5, 6, 7], SHORT), s.submit([8, 9, 10, 11, 12, 13], SHORT)
    plan, _ = step(s)
    assert [(c.group.requests, c.slots, c.last) for c in plan.chunks] == [([first, second], [0, 1], False)]
    late = s.submit([14, 15], SHORT)
    plan, changed = step(s)
    # nothing decodes yet; the late one is a group of its own, next to them
    assert plan.calls == [] and [(c.group.requests, c.slots) for c in plan.chunks] == \
        [([first, second], [0, 1]), ([late], [2])]
    assert set(changed) == {first, second, late}
    s.cancel(late)
    plan, _ = step(s)
    call, = plan.calls
    assert call.requests == [first, second, None, None] and call.slots is None
    # a freed slot is a frozen row at what its caches hold (late left after its first token)
    assert call.anchor_pos == [3, 6, 2, 0] and call.state_slot == [0, 0, 0, 0]


def test_a_frozen_row_of_a_prefilling_request_is_at_its_prompts_rows_so_far():
    s = scheduler(pool=2, pooled=True)
    running = s.submit([5, 6], SHORT)
    step(s)
    long = s.submit(list(range(10, 21)), SHORT)
    plan, _ = step(s)
    call, = plan.calls
    assert call.requests == [running, None] and call.anchor_pos == [2, 0] and long.anchor_pos == 4
    plan, _ = step(s)
    assert plan.calls[0].anchor_pos == [3, 4] and plan.calls[0].context_start == [3, 4]


def test_eos_and_the_budget_end_a_request_and_free_its_slot_for_the_next():
    s = scheduler(pool=1)
    stops, waits = s.submit([5, 6], SHORT), s.submit([7, 8], Params(max_new_tokens=3))
    step(s)
    plan, changed = step(s, {stops.id: [30, EOS, 31]})
    assert changed == [stops] and stops.token_ids == [40, 30, EOS] and stops.finish_reason == "stop"
    assert stops.status is Status.FINISHED and s.slots == [None]
    plan, _ = step(s)
    assert [a.request for a in plan.admitted] == [waits] and plan.admitted[0].slot == 0
    step(s, {waits.id: [32, 33, 34]})
    assert waits.token_ids == [41, 32, 33] and waits.finish_reason == "length" and not s.busy


def test_a_prompt_that_begins_with_a_free_slots_sequence_goes_there_and_prefills_the_rest():
    s = scheduler(pool=2)
    first = s.submit([5, 6, 7, 8], Params(max_new_tokens=3))
    step(s)
    step(s, {first.id: [20, 21]})
    assert first.finished and s.held[0].tokens == [5, 6, 7, 8, 40, 20]
    assert s.held[0].draft_rows == 4 and s.held[0].pending.count == 2   # the last step's rows, not read
    turn = s.submit([5, 6, 7, 8, 40, 20, 21, 9, 10], SHORT)
    plan, _ = step(s)
    admission, = plan.admitted
    assert admission.slot == 0 and not admission.clear and turn.reused == 6
    assert admission.pending.start == 4 and admission.pending.count == 2
    assert plan.chunks[0].group.rows == 3 and plan.chunks[0].last
    assert turn.context.start == 6 and turn.token_ids == [41]
    # a request that scores its prompt computes every row of it: a cleared slot
    scored = s.submit([5, 6, 7, 8, 40, 20], replace(SHORT, prompt_logprobs=1))
    plan, _ = step(s)
    assert plan.admitted[0].slot == 1 and plan.admitted[0].clear and scored.reused == 0


def test_admitting_requests_reads_only_the_free_slots_that_hold_rows(monkeypatch):
    """Admission is linear in the requests admitted: each reads the caches of the free slots that
    hold rows, and takes the oldest free slot when none begins its prompt. (Each read every free
    slot: 4000 prompts given at once to ``generate`` spent 24 s in ``Held.reusable``.)"""
    s = scheduler(pool=64, limits=replace(LIMITS, max_batch=64))
    s.submit([5, 6, 7, 8], Params(max_new_tokens=1))
    step(s)
    assert not s.busy and s.held[0].tokens
    reads = []
    reusable = Held.reusable
    monkeypatch.setattr(Held, "reusable", lambda held, *args: reads.append(held) or reusable(held, *args))
    requests = [s.submit([5, 6, 7, 8, 9], SHORT), *(s.submit([30 + i], SHORT) for i in range(63))]
    plan = s.schedule()
    assert len(plan.admitted) == 64 and len(reads) == 1     # slot 0's, for the first request
    assert requests[0].slot == 0 and requests[0].reused > 0
    assert [r.slot for r in requests[1:]] == list(range(1, 64))


@pytest.mark.parametrize("state_slots", [0, 4])
def test_a_target_that_cannot_go_back_reuses_the_whole_sequence_or_nothing(state_slots):
    s = scheduler(pool=1, limits=replace(LIMITS, state_slots=state_slots))
    target_only = Params(max_new_tokens=2, speculative=False)
    first = s.submit([5, 6, 7, 8], target_only)
    step(s)
    step(s)
    assert first.finished and s.held[0].tokens == [5, 6, 7, 8, 40]
    second = s.submit([5, 6, 7, 8, 9], target_only)     # begins with 4 of the 5 rows held
    plan, _ = step(s)
    assert plan.admitted[0].clear == bool(state_slots) and second.reused == (0 if state_slots else 4)


def test_cancelling_frees_the_slot_or_waits_for_the_group_it_prefills_with():
    s = scheduler(pool=2, pooled=True)
    a, b = s.submit(list(range(5, 15)), SHORT), s.submit([20, 21], SHORT)
    step(s)
    s.cancel(b)
    assert b.finish_reason == "cancelled" and s.slots == [a, b]    # its group still writes its slot
    step(s)
    plan, changed = step(s)
    assert changed == [a] and s.slots == [a, None] and b.token_ids == []
    s.cancel(a)
    assert s.slots == [None, None]
    waiting = s.submit([5, 6], SHORT)
    s.cancel(waiting)
    assert not s.busy and s.schedule().empty


def test_the_cap_follows_the_busy_slots_and_a_cap_of_0_keeps_the_rows_for_the_draft():
    s = scheduler(pool=2, draft_schedule=LoadSchedule(((1, 3), (2, 0))))
    first = s.submit([5, 6, 7], SHORT)
    step(s)
    plan, _ = step(s)
    assert plan.calls[0].cap == 3
    s.submit(list(range(10, 30)), SHORT)      # prefilling, it takes the machine's time too
    plan, _ = step(s, {first.id: [50]})
    call, = plan.calls
    assert call.cap == 0 and not call.drafting and first.stats.idle_steps == 1
    # each target-only step's row is added to the context the draft reads at its next call
    context = first.context.start, first.context.count
    plan, _ = step(s, {first.id: [51]})
    assert (first.context.start, first.context.count) == (context[0], context[1] + 1)


def test_a_draft_schedule_is_asked_for_each_cap_and_told_each_step():
    class Recording:
        def __init__(self):
            self.caps, self.records = [], []

        def estimate(self):
            return "estimate"

        def cap(self, drafters, others, batch, busy):
            self.caps.append((drafters, others, batch, busy))
            return 2

        def record(self, acceptance, cap, verified, accepted):
            self.records.append((acceptance, cap, verified, accepted))

    schedule = Recording()
    s = scheduler(pool=2, draft_schedule=schedule)
    request = s.submit([5, 6], SHORT)
    s.submit([7, 8], replace(SHORT, speculative=False))
    step(s)
    step(s, {request.id: [20, 21]})
    assert request.acceptance == "estimate"
    assert schedule.caps == [(["estimate"], 0, 1, 2)] and schedule.records == [("estimate", 2, 1, 1)]


def test_bad_options_are_refused_in_one_line():
    with pytest.raises(ValueError, match="proposes 3 drafts per step"):
        scheduler(draft_schedule=LoadSchedule.constant(4))
    with pytest.raises(ValueError, match="at most 4"):
        scheduler(pool=5)
    with pytest.raises(ValueError, match="request 2 has 60 tokens.*capacity is 64"):
        scheduler().submit(list(range(60)), Params(max_new_tokens=8), name="request 2")
