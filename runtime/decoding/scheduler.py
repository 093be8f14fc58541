"""Continuous batching over the backend's cache slots: which requests share each speculative step
(``step.py``), on which slots, at what cap (``docs/dspark.md#the-propose-verify-loop``).

The backend's caches are a pool of slots, one request each. A submitted request waits for a free
slot and is prefilled there one prompt chunk per step (so a long prompt never stalls the running
requests for long), samples its first token and joins the decoding requests at the next step. A
finished or cancelled request frees its slot at once and leaves its caches there: the next request
goes to the free slot that holds the longest beginning of its prompt and prefills only the rest
(``prefix_cache.py``), else to the free slot left longest ago, cleared. Each request has its own
``max_new_tokens``, temperature, top-p, top-k, min-p, penalties, seed (its noise by position,
``noise.py``), stop strings, log-probabilities and speculation on or off. How many drafts a
step verifies is the verification policy's cap, below the confidence cut: a fixed one by the
number of busy slots (``draft_schedule.py``), or the one that the requests' own acceptance and the
measured call costs say pays best (``adaptive.py``).

A backend either runs steps on any slots (ONNX Runtime: one sequence per call), and then requests
with speculation verify their drafts in one call and those without decode in another; or it is
``pooled`` (CUDA graphs captured on the whole pool's caches, the PyTorch reference's batched
steps): every decode step then runs every slot in order, one call for all, and a
slot without a decoding request is a frozen row that writes only scratch past its valid rows;
requests admitted together are prefilled together, on a block of consecutive slots.
``batch.Decoding`` (a batch of prompts started together) is this loop with a pool of the
batch's size.

Greedy output is the target's own greedy output whatever else runs, and a sampled request's is the
target's own sample for its seed: the noise of each position is the seed's, whatever the cap, the
drafts and the other requests (on a backend whose rows do not depend on their neighbours, as ONNX
Runtime's, the same tokens, load or no load).
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import replace
from functools import partial

import torch

from runtime.backends.base import Backend, capacity_needed, torch_threads
from runtime.decoding.draft_schedule import DraftSchedule, LoadSchedule
from runtime.decoding.logprobs import token_logprobs
from runtime.decoding.noise import Noise
from runtime.decoding.params import Params
from runtime.decoding.penalties import Penalties
from runtime.decoding.prefill import insert_context, prefill_chunks
from runtime.decoding.prefix_cache import Held
from runtime.decoding.request import DraftContext, Prefill, Request, extend
from runtime.decoding.sampling import next_token
from runtime.decoding.stats import PhaseTimes, SpecStats
from runtime.decoding.step import Call, Verdict, speculative_step

__all__ = ["Params", "Request", "Scheduler", "check_capacity"]


class Scheduler:
    """``submit`` requests at any time; each ``step`` admits waiting requests into free slots,
    runs one decode step of the running ones and one prefill chunk of each prefilling group, and
    returns the requests that gained tokens (or ended) in it. ``pool`` slots (default: the
    engine's ``max_batch``); ``times`` sums the wall time of every step."""

    def __init__(self, backend: Backend, eos_token_ids=None, confidence_threshold: float | None = None,
                 draft_schedule: DraftSchedule | None = None, pool: int | None = None):
        self.backend, self.limits = backend, backend.limits
        self.schedule = draft_schedule or LoadSchedule.constant(self.limits.k)
        fixed = isinstance(self.schedule, LoadSchedule)
        if fixed and any(d > self.limits.k for _, d in self.schedule.steps):
            raise ValueError(f"draft schedule {self.schedule}: the engine proposes {self.limits.k} "
                             f"drafts per step (k)")
        self.eos = set(self.limits.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.threshold = (self.limits.confidence_threshold if confidence_threshold is None
                          else confidence_threshold)
        if not 0 <= self.threshold <= 1:
            raise ValueError(f"confidence_threshold {self.threshold}: expected 0 (verify every draft) .. 1")
        pool = self.limits.max_batch if pool is None else pool
        self.limits.check_batch(pool)
        self.pooled = backend.pooled
        self.slots: list[Request | None] = [None] * pool
        self.held = [Held() for _ in range(pool)]     # what each slot's caches hold
        self.releases = itertools.count(1)
        # a target that cannot go back to an earlier row reuses a slot's whole sequence or nothing
        self.exact = self.limits.state_slots > 0 or self.limits.rings
        self.waiting: deque[Request] = deque()
        self.ids = itertools.count()
        self.device = backend.device
        self.times = PhaseTimes()
        self.started = False       # the caches are emptied at the first step, not before

    def submit(self, prompt: list[int], params: Params | None = None, name: str = "prompt") -> Request:
        """Queue ``prompt``; refused in one line (naming ``name``) when it cannot fit a slot."""
        params = params or Params()
        params.check()
        speculative = params.speculative and self.limits.k > 0
        # a pooled step gives a request without speculation the verify block's rows too
        check_capacity(self.backend, [prompt], params.max_new_tokens, speculative or self.pooled, [name])
        request = Request(next(self.ids), list(prompt), replace(params, speculative=speculative),
                          stats=SpecStats(k=self.limits.k if speculative else 0),
                          acceptance=self.schedule.estimate() if speculative else None,
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
        request.finish_reason = "cancelled"
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

    def run(self) -> None:
        """Step until every submitted request has ended."""
        while self.busy:
            self.step()

    def step(self) -> list[Request]:
        """One step boundary: admit, decode the running requests, prefill a chunk of the others."""
        with torch_threads(self.backend.host_threads), self.times.measure("total"):
            if not self.started:
                self.backend.start(len(self.slots))
                self.started = True
            return self._step()

    def _step(self) -> list[Request]:
        self._admit()
        running = [r for r in self.slots if r is not None and r.prefill is None]
        changed, busy = [], self.occupied
        if self.pooled and running:
            changed += self._decode(list(self.slots), busy)
        elif running:
            for group in ([r for r in running if r.params.speculative],
                          [r for r in running if not r.params.speculative]):
                if group:
                    changed += self._decode(group, busy)
        for prefill in dict.fromkeys(r.prefill for r in self.slots if r is not None and r.prefill):
            changed += self._prefill_chunk(prefill)
        return changed

    def _admit(self) -> None:
        """Waiting requests into free slots (``_place``); each is prefilled alone, or on a pooled
        backend with those admitted into the slots next to it."""
        free = [slot for slot, occupant in enumerate(self.slots) if occupant is None]
        placed = []
        while free and self.waiting:
            request = self.waiting.popleft()
            free.remove(self._place(request, free))
            placed.append(request)
        admitted: list[list[Request]] = []
        for request in sorted(placed, key=lambda r: r.slot):
            if self.pooled and admitted and admitted[-1][-1].slot == request.slot - 1:
                admitted[-1].append(request)
            else:
                admitted.append([request])
        for group in admitted:
            prompts = [r.prompt[r.reused:] for r in group]
            lengths = torch.tensor(list(map(len, prompts)), device=self.device)
            scored = [b for b, r in enumerate(group) if r.params.prompt_logprobs is not None]
            prefill = Prefill(group, prefill_chunks(
                self.backend, prompts, lengths, any(r.params.speculative for r in group),
                self._prompt_scorer(group, scored) if scored else None,
                slots=self._slots([r.slot for r in group]),
                offsets=torch.tensor([r.reused for r in group], device=self.device),
                state_slot=torch.tensor([r.state_slot for r in group], device=self.device)))
            for request in group:
                request.prefill = prefill

    def _place(self, request: Request, free: list[int]) -> int:
        """Put ``request`` in the free slot whose caches hold the longest beginning of its prompt
        (none for a request that scores its prompt: every row of it is computed), else in the one
        left longest ago, cleared; its draft context rows still pending there are inserted now."""
        speculative = request.params.speculative
        reuse = {slot: 0 if request.params.prompt_logprobs is not None
                 else self.held[slot].reusable(request.prompt, speculative, self.exact) for slot in free}
        slot = max(free, key=lambda s: (reuse[s], -self.held[s].since))
        held, request.slot, self.slots[slot] = self.held[slot], slot, request
        request.reused = request.anchor_pos = reuse[slot]
        if not request.reused:
            self.backend.clear(slot)
            self.held[slot] = Held()
            return slot
        request.state_slot = held.state_slot
        if speculative and held.draft_rows < request.reused:
            pending, on_device = held.pending, partial(torch.tensor, device=self.device)
            count = request.reused - pending.start
            insert_context(self.backend, pending.rows[None, :count], on_device([pending.start]),
                           on_device([count]), on_device([request.prompt[request.reused]]), [slot])
        return slot

    @staticmethod
    def _prompt_scorer(group: list[Request], scored: list[int]):
        """What a prefill calls with each chunk's logits of every row: the log-probabilities of the
        prompt tokens they predict, for the requests (``scored``, by their place in ``group``) that
        asked for them."""
        def score(begin: int, logits: torch.Tensor) -> None:
            for b in scored:
                request = group[b]
                tokens = request.prompt[begin + 1:begin + 1 + logits.shape[1]]
                request.prompt_logprobs += token_logprobs(logits[b], tokens, request.params.prompt_logprobs)
        return score

    def _slots(self, slots: list[int]) -> list[int] | None:
        """The ``slots`` argument of a call on ``slots``: None for the whole pool in order."""
        return None if slots == list(range(len(self.slots))) else slots

    def _prefill_chunk(self, prefill: Prefill) -> list[Request]:
        """One chunk of a group's prompts; after the last, each one's first token."""
        with self.times.measure("prefill"):
            done = next(prefill.chunks)
        group = prefill.requests
        if done is None:
            prefill.done += self.limits.max_prompt_chunk
            for request in group:
                request.anchor_pos = min(len(request.prompt), request.reused + prefill.done)
            return []
        last_logits, (aux, ctx_start, ctx_count) = done
        tokens = []
        for b, request in enumerate(group):
            p, logits = request.params, last_logits[b]
            if request.penalty is not None:
                logits = request.penalty(logits[None])[0]
            noise = request.noise.rows(0, 1)[0] if request.noise is not None else None
            tokens.append(next_token(logits, p.temperature, p.top_p, noise, p.top_k, p.min_p))
        starts, counts, tokens = ctx_start.tolist(), ctx_count.tolist(), torch.stack(tokens).tolist()
        changed = []
        for b, request in enumerate(group):
            request.prefill = None
            if request.finished:      # cancelled while its group prefilled: the slot is free now
                self._release(request)
                continue
            # a copy: an engine backend's output buffers are reused by the next call of the same shape
            if request.params.speculative:
                request.context = DraftContext(aux[b, :counts[b]].clone(), starts[b])
            request.anchor_pos = len(request.prompt)
            self._emit(request, [tokens[b]], last_logits[b, None], anchor=None, drafts=[], accepted=0)
            changed.append(request)
        return changed

    def _decode(self, rows: list[Request | None], busy: int) -> list[Request]:
        """One speculative step (``step.py``) of ``rows``: the running requests of one kind (with
        speculation or without) on their slots, or on a pooled backend every slot in order, where an
        empty or prefilling one is a frozen row; then each running request advances."""
        call = self._call(rows, busy)
        step = speculative_step(self.backend, call, self.threshold, self.times)
        live = call.live
        for b in live:
            self._advance(call.requests[b], step.verdicts[b], step.taps[b], step.logits[b], call)
        return [call.requests[b] for b in live]

    def _call(self, rows: list[Request | None], busy: int) -> Call:
        """The call of ``rows``. It verifies at most the schedule's cap for ``busy`` occupied slots (a
        prefilling request's takes the machine's time too, and a request that ends and one that joins
        leave the cap as it was); at a cap of 0 it skips the draft and keeps the verified rows for
        the draft's next call, which comes when the rows fill one call (``limits.call_rows``) if not
        sooner. A frozen row writes scratch from its slot's valid length, and keeps its state."""
        running = [r if r is not None and r.prefill is None else None for r in rows]
        live = [r for r in running if r is not None]
        drafters = [r for r in live if r.params.speculative]
        cap = self.schedule.cap([r.acceptance for r in drafters], len(live) - len(drafters),
                                len(rows), busy) if drafters else 0
        drafting = bool(drafters) and (cap > 0 or any(r.context.count >= self.limits.call_rows
                                                      for r in drafters))
        anchor, anchor_pos, state_slot, context_start = [], [], [], []
        for b, (row, request) in enumerate(zip(rows, running)):
            if request is not None:
                values = request.anchor, request.anchor_pos, request.state_slot, request.anchor_pos
            elif row is not None:     # prefilling: at its prompt's rows so far, state in slot 0
                values = 0, row.anchor_pos, 0, row.anchor_pos
            else:                     # the pool's empty slot b: at what its caches hold
                values = 0, len(self.held[b].tokens), self.held[b].state_slot, self.held[b].draft_rows
            for column, value in zip((anchor, anchor_pos, state_slot, context_start), values):
                column.append(value)
        on_device = partial(torch.tensor, device=self.device)
        return Call(running, on_device(anchor), on_device(anchor_pos), on_device(state_slot), context_start,
                    cap, drafting, None if self.pooled else self._slots([r.slot for r in rows]))

    def _advance(self, request: Request, verdict: Verdict, taps: torch.Tensor, logits: torch.Tensor,
                 call: Call) -> None:
        """What ``request`` keeps of its step: its statistics and acceptance, its verified rows as
        the draft's context (after the rows pending, when the draft did not run), its anchor's
        position and state slot, and the tokens it emitted."""
        accepted, verifying = verdict.accepted, call.cap > 0
        if not request.params.speculative or verifying:
            request.stats.record(accepted, verdict.verified, call.cap)
        if request.params.speculative:
            request.stats.idle_steps += not verifying
            self.schedule.record(request.acceptance, call.cap, verdict.verified, accepted)
            if call.drafting:
                request.context = DraftContext(taps[:accepted + 1].clone(), request.anchor_pos)
            else:     # the draft has not read the rows before: they go in with this one
                request.context = request.context.then(taps[0])
        request.anchor_pos += accepted + 1
        request.state_slot = accepted
        self._emit(request, verdict.emitted, logits, anchor=request.anchor, drafts=verdict.drafts,
                   accepted=accepted)

    def _emit(self, request: Request, tokens: list[int], logits: torch.Tensor, **record) -> None:
        """Append ``tokens`` up to the first EOS, stop string or the budget, their log-probabilities
        if asked (from ``logits [>= len(tokens), V]``, the target's rows that predicted them), and
        the step's trace record; end the request there."""
        p, before = request.params, len(request.token_ids)
        request.finish_reason = extend(request.token_ids, tokens, p.max_new_tokens, self.eos, p.stop)
        new = request.token_ids[before:]
        if p.logprobs is not None:
            request.logprobs += token_logprobs(logits, new, p.logprobs)
        if request.penalty is not None:
            request.penalty.record(new)
        request.trace.append({"step": len(request.trace), **record, "emitted": new})
        if request.finished:
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


def check_capacity(backend: Backend, prompts: list[list[int]], max_new_tokens: int, speculative: bool,
                   names: list[str]) -> None:
    """Refuse the first prompt that is empty or whose tokens, ``max_new_tokens`` and the rows a
    step may write past them do not fit the KV cache, naming it."""
    limits = backend.limits
    for name, prompt in zip(names, prompts):
        if not prompt:
            raise ValueError(f"{name}: no tokens; expected at least one")
        needed = capacity_needed(len(prompt), max_new_tokens, limits if speculative else None)
        if needed > limits.capacity:
            raise ValueError(f"{name} has {len(prompt)} tokens: with max_new_tokens {max_new_tokens} "
                             f"it needs {needed} KV-cache rows; the capacity is "
                             f"{limits.capacity} (build --max-seq-len)")

