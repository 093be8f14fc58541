"""Continuous batching's decisions over a pool of cache slots: which requests share each
speculative step (``step.py``), on which slots, at what cap (``docs/dspark.md#the-propose-verify-loop``).
The scheduler runs nothing: ``schedule`` writes what the next step runs as a ``Plan``, the
executor runs it on a backend (``executor.py``), and ``update`` applies its ``Outcome``
(``batcher.py`` joins the three), so that its decisions are tested with hand-made outcomes.

The backend's caches are a pool of slots, one request each. A submitted request waits for a free
slot and is prefilled there one prompt chunk per step (so a long prompt never stalls the running
requests for long), samples its first token and joins the decoding requests at the next step. A
finished or cancelled request frees its slot at once and leaves its caches there: the next request
goes to the free slot that holds the longest beginning of its prompt and prefills only the rest
(``prefix_cache.py``), else to the free slot left longest ago, cleared. Each request has its own
``max_new_tokens``, temperature, top-p, top-k, min-p, penalties, seed (its noise by position,
``noise.py``), stop strings, log-probabilities and speculation on or off. How many drafts a
step verifies is the draft schedule's cap, below the confidence cut: a fixed one by the
number of busy slots (``draft_schedule.py``), or the one that the requests' own acceptance and the
measured call costs say pays best (``adaptive.py``).

A backend either runs steps on any slots (ONNX Runtime: one sequence per call), and then requests
with speculation verify their drafts in one call and those without decode in another; or it is
``pooled`` (CUDA graphs captured on the whole pool's caches, the PyTorch reference's batched
steps): every decode step then runs every slot in order, one call for all, and a
slot without a decoding request is a frozen row that writes only scratch past its valid rows;
requests admitted together are prefilled together, on a block of consecutive slots.

Greedy output is the target's own greedy output whatever else runs, and a sampled request's is the
target's own sample for its seed: the noise of each position is the seed's, whatever the cap, the
drafts and the other requests (on a backend whose rows do not depend on their neighbours, as ONNX
Runtime's, the same tokens, load or no load).
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import replace

import torch

from runtime.backends.base import BackendLimits, capacity_needed
from runtime.decoding.draft_schedule import DraftSchedule, LoadSchedule
from runtime.decoding.logprobs import token_logprobs
from runtime.decoding.noise import Noise
from runtime.decoding.params import Params
from runtime.decoding.penalties import Penalties
from runtime.decoding.plan import Admission, Chunk, Decoded, Outcome, Plan, Prefilled
from runtime.decoding.prefix_cache import Held
from runtime.decoding.request import DraftContext, Prefill, Request, Status, extend
from runtime.decoding.stats import SpecStats
from runtime.decoding.step import Call

__all__ = ["Params", "Request", "Scheduler", "check_capacity"]


class Scheduler:
    """``submit`` requests at any time; ``schedule`` admits waiting requests into free slots and
    plans one decode step of the decoding ones and one prefill chunk of each prefilling group;
    ``update`` applies what that step gave and returns the requests that gained tokens (or ended)
    in it. ``limits`` are the backend's, ``pooled`` and ``device`` too; ``pool`` slots (default:
    ``limits.max_batch``)."""

    def __init__(self, limits: BackendLimits, *, pooled: bool = False, device: torch.device | str = "cpu",
                 eos_token_ids=None, draft_schedule: DraftSchedule | None = None, pool: int | None = None):
        self.limits, self.pooled, self.device = limits, pooled, torch.device(device)
        self.draft_schedule = draft_schedule or LoadSchedule.constant(limits.k)
        fixed = isinstance(self.draft_schedule, LoadSchedule)
        if fixed and any(d > limits.k for _, d in self.draft_schedule.steps):
            raise ValueError(f"draft schedule {self.draft_schedule}: the engine proposes {limits.k} "
                             f"drafts per step (k)")
        self.eos = set(limits.eos_token_ids if eos_token_ids is None else eos_token_ids)
        pool = limits.max_batch if pool is None else pool
        limits.check_batch(pool)
        self.slots: list[Request | None] = [None] * pool
        self.held = [Held() for _ in range(pool)]     # what each slot's caches hold
        self.releases = itertools.count(1)
        # a target that cannot go back to an earlier row reuses a slot's whole sequence or nothing
        self.exact = limits.state_slots > 0 or limits.rings
        self.waiting: deque[Request] = deque()
        self.ids = itertools.count()

    def submit(self, prompt: list[int], params: Params | None = None, name: str = "prompt") -> Request:
        """Queue ``prompt``; refused in one line (naming ``name``) when it cannot fit a slot."""
        params = params or Params()
        params.check()
        speculative = params.speculative and self.limits.k > 0
        # a pooled step gives a request without speculation the verify block's rows too
        check_capacity(self.limits, [prompt], params.max_new_tokens, speculative or self.pooled, [name])
        request = Request(next(self.ids), list(prompt), replace(params, speculative=speculative),
                          stats=SpecStats(k=self.limits.k if speculative else 0),
                          acceptance=self.draft_schedule.estimate() if speculative else None,
                          noise=Noise(params.seed, self.limits.vocab_size, self.device)
                          if params.temperature > 0 else None)
        if params.penalized:
            request.penalty = Penalties(params.repetition_penalty, params.presence_penalty,
                                        params.frequency_penalty, prompt, self.limits.vocab_size, self.device)
        self.waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """End ``request`` now; its slot is free for the next step (once the requests prefilled
        with it are, when it is cancelled while prefilling)."""
        if request.finished:
            return
        request.finish("cancelled")
        if request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    @property
    def occupied(self) -> int:
        """Slots holding a request, prefilling or decoding: the load the draft schedule reads."""
        return sum(r is not None for r in self.slots)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.occupied > 0

    def schedule(self) -> Plan:
        """The next step: admissions into free slots, the decode calls, a chunk of each prefilling
        group (the ones admitted now included)."""
        admitted = self._admit()
        decoding = [r for r in self.slots if r is not None and r.status is Status.DECODING]
        busy = self.occupied
        if self.pooled and decoding:
            calls = [self._call(list(self.slots), busy)]
        else:
            kinds = ([r for r in decoding if r.params.speculative],
                     [r for r in decoding if not r.params.speculative])
            calls = [self._call(rows, busy) for rows in kinds if rows]
        groups = dict.fromkeys(r.prefill for r in self.slots if r is not None and r.prefill is not None)
        chunks = [Chunk(group, group.done + self.limits.max_prompt_chunk >= group.rows,
                        self._slots([r.slot for r in group.requests])) for group in groups]
        return Plan(admitted, calls, chunks)

    def update(self, plan: Plan, outcome: Outcome) -> list[Request]:
        """Apply ``outcome``, the results of running ``plan``; the requests that gained tokens or
        ended, decode calls' first."""
        changed = []
        for call, decoded in zip(plan.calls, outcome.decoded):
            for b, result in decoded.items():
                self._advance(call.requests[b], result, call)
                changed.append(call.requests[b])
        for chunk, prefilled in zip(plan.chunks, outcome.prefilled):
            changed += self._prefilled(chunk, prefilled)
        return changed

    def _admit(self) -> list[Admission]:
        """Waiting requests into free slots (``_place``); each is prefilled alone, or on a pooled
        backend with those admitted into the slots next to it."""
        # the free slots oldest first (left longest ago, then by index), and those whose caches hold
        # rows: a request reads only those (admitting N requests into N slots stays linear in N)
        free = sorted((slot for slot, occupant in enumerate(self.slots) if occupant is None),
                      key=lambda slot: (self.held[slot].since, slot))
        holding = [slot for slot in free if self.held[slot].tokens]
        admitted = []
        while free and self.waiting:
            admission = self._place(self.waiting.popleft(), free, holding)
            free.remove(admission.slot)
            if admission.slot in holding:
                holding.remove(admission.slot)
            admitted.append(admission)
        groups: list[list[Request]] = []
        for request in sorted((a.request for a in admitted), key=lambda r: r.slot):
            if self.pooled and groups and groups[-1][-1].slot == request.slot - 1:
                groups[-1].append(request)
            else:
                groups.append([request])
        for group in groups:
            prefill = Prefill(group)
            for request in group:
                request.prefill, request.status = prefill, Status.PREFILLING
        return admitted

    def _place(self, request: Request, free: list[int], holding: list[int]) -> Admission:
        """Put ``request`` in the free slot whose caches hold the longest beginning of its prompt
        (the oldest of those; none for a request that scores its prompt: every row of it is
        computed), else in the one left longest ago (``free[0]``), cleared; its draft context rows
        still pending there are inserted first. ``holding``: the free slots that hold rows, oldest
        first."""
        speculative = request.params.speculative
        slot, reused = free[0], 0
        if request.params.prompt_logprobs is None and holding:
            reuse = {s: self.held[s].reusable(request.prompt, speculative, self.exact) for s in holding}
            best = max(holding, key=reuse.__getitem__)      # the first, so the oldest, of the longest
            if reuse[best]:
                slot, reused = best, reuse[best]
        held, request.slot, self.slots[slot] = self.held[slot], slot, request
        request.reused = request.anchor_pos = reused
        if not request.reused:
            self.held[slot] = Held()
            return Admission(request, slot, clear=True)
        request.state_slot = held.state_slot
        pending = None
        if speculative and held.draft_rows < request.reused:
            rows = held.pending.rows[:request.reused - held.pending.start]
            pending = DraftContext(rows, held.pending.start)
        return Admission(request, slot, clear=False, pending=pending)

    def _slots(self, slots: list[int]) -> list[int] | None:
        """The ``slots`` argument of a call on ``slots``: None for the whole pool in order."""
        return None if slots == list(range(len(self.slots))) else slots

    def _prefilled(self, chunk: Chunk, prefilled: Prefilled) -> list[Request]:
        """A group's chunk done; after the last, each request's first token."""
        group = chunk.group
        for request, scored in zip(group.requests, prefilled.prompt_logprobs):
            request.prompt_logprobs += scored
        if not chunk.last:
            group.done += self.limits.max_prompt_chunk
            for request in group.requests:
                request.anchor_pos = min(len(request.prompt), request.reused + group.done)
            return []
        changed = []
        for b, request in enumerate(group.requests):
            request.prefill = None
            if request.finished:      # cancelled while its group prefilled: the slot is free now
                self._release(request)
                continue
            request.status, request.context = Status.DECODING, prefilled.contexts[b]
            request.anchor_pos = len(request.prompt)
            logits = None if prefilled.logits is None else prefilled.logits[b, None]
            self._emit(request, [prefilled.tokens[b]], logits, anchor=None, drafts=[], accepted=0)
            changed.append(request)
        return changed

    def _call(self, rows: list[Request | None], busy: int) -> Call:
        """The call of ``rows``. It verifies at most the schedule's cap for ``busy`` occupied slots (a
        prefilling request's takes the machine's time too, and a request that ends and one that joins
        leave the cap as it was); at a cap of 0 it skips the draft and keeps the verified rows for
        the draft's next call, which comes when the rows fill one call (``limits.call_rows``) if not
        sooner. A frozen row writes scratch from its slot's valid length, and keeps its state."""
        decoding = [r if r is not None and r.status is Status.DECODING else None for r in rows]
        live = [r for r in decoding if r is not None]
        drafters = [r for r in live if r.params.speculative]
        cap = self.draft_schedule.cap([r.acceptance for r in drafters], len(live) - len(drafters),
                                      len(rows), busy) if drafters else 0
        drafting = bool(drafters) and (cap > 0 or any(r.context.count >= self.limits.call_rows
                                                      for r in drafters))
        anchor, anchor_pos, state_slot, context_start = [], [], [], []
        for b, (row, request) in enumerate(zip(rows, decoding)):
            if request is not None:
                values = request.anchor, request.anchor_pos, request.state_slot, request.anchor_pos
            elif row is not None:     # prefilling: at its prompt's rows so far, state in slot 0
                values = 0, row.anchor_pos, 0, row.anchor_pos
            else:                     # the pool's empty slot b: at what its caches hold
                values = 0, len(self.held[b].tokens), self.held[b].state_slot, self.held[b].draft_rows
            for column, value in zip((anchor, anchor_pos, state_slot, context_start), values):
                column.append(value)
        return Call(decoding, anchor, anchor_pos, state_slot, context_start, cap, drafting,
                    None if self.pooled else self._slots([r.slot for r in rows]))

    def _advance(self, request: Request, decoded: Decoded, call: Call) -> None:
        """What ``request`` keeps of its step: its statistics and acceptance, its verified rows as
        the draft's context (after the rows pending, when the draft did not run), its anchor's
        position and state slot, and the tokens it emitted."""
        verdict = decoded.verdict
        accepted, verifying = verdict.accepted, call.cap > 0
        if not request.params.speculative or verifying:
            request.stats.record(accepted, verdict.verified, call.cap)
        if request.params.speculative:
            request.stats.idle_steps += not verifying
            self.draft_schedule.record(request.acceptance, call.cap, verdict.verified, accepted)
            if call.drafting:
                request.context = DraftContext(decoded.taps, request.anchor_pos)
            else:     # the draft has not read the rows before: they go in with this one
                request.context = request.context.then(decoded.taps[0])
        request.anchor_pos += accepted + 1
        request.state_slot = accepted
        self._emit(request, verdict.emitted, decoded.logits, anchor=request.anchor, drafts=verdict.drafts,
                   accepted=accepted)

    def _emit(self, request: Request, tokens: list[int], logits: torch.Tensor | None, **record) -> None:
        """Append ``tokens`` up to the first EOS, stop string or the budget, their log-probabilities
        if asked (from ``logits [>= len(tokens), V]``, the target's rows that predicted them), and
        the step's trace record; end the request there."""
        p, before = request.params, len(request.token_ids)
        reason = extend(request.token_ids, tokens, p.max_new_tokens, self.eos, p.stop)
        new = request.token_ids[before:]
        if p.logprobs is not None:
            request.logprobs += token_logprobs(logits, new, p.logprobs)
        if request.penalty is not None:
            request.penalty.record(new)
        request.trace.append({"step": len(request.trace), **record, "emitted": new})
        if reason is not None:
            request.finish(reason)
            self._release(request)
        else:
            request.anchor = request.token_ids[-1]
            if request.noise is not None:
                request.noise.forget(below=len(request.token_ids))

    def _release(self, request: Request) -> None:
        """Free ``request``'s slot, unless requests prefilled with it still write theirs, and
        record what its caches hold."""
        prefill = request.prefill
        if prefill is not None and not all(r.finished for r in prefill.requests):
            return
        for r in prefill.requests if prefill is not None else [request]:
            if r.slot is not None and self.slots[r.slot] is r:
                self.slots[r.slot] = None
                self.held[r.slot] = self._held(r)
            r.prefill = None

    def _held(self, request: Request) -> Held:
        """What ``request`` leaves in its slot's caches: its sequence's rows up to its anchor (those
        of tokens it kept; a hybrid's state is after the anchor's row only), the draft's context
        rows, inserted or pending; nothing when it ended while prefilling."""
        if request.prefill is not None:
            return Held(since=next(self.releases))
        sequence = request.prompt + request.token_ids
        valid = min(request.anchor_pos, len(sequence))
        if self.exact and valid < request.anchor_pos:
            return Held(since=next(self.releases))
        before = self.held[request.slot]
        if request.context is not None:
            pending, draft_rows = request.context, request.context.start
        else:   # without drafts: what its slot's draft context held, as far as it reused it
            pending, draft_rows = None, min(before.draft_rows, request.reused)
        return Held(sequence[:valid], draft_rows, pending, request.state_slot, next(self.releases))


def check_capacity(limits: BackendLimits, prompts: list[list[int]], max_new_tokens: int, speculative: bool,
                   names: list[str]) -> None:
    """Refuse the first prompt that is empty or whose tokens, ``max_new_tokens`` and the rows a
    step may write past them do not fit the KV cache, naming it."""
    for name, prompt in zip(names, prompts):
        if not prompt:
            raise ValueError(f"{name}: no tokens; expected at least one")
        needed = capacity_needed(len(prompt), max_new_tokens, limits if speculative else None)
        if needed > limits.capacity:
            raise ValueError(f"{name} has {len(prompt)} tokens: with max_new_tokens {max_new_tokens} "
                             f"it needs {needed} KV-cache rows; the capacity is "
                             f"{limits.capacity} (build --max-seq-len)")
