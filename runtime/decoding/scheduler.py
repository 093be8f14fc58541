"""The propose / verify loop, as continuous batching over the backend's cache slots
(``docs/dspark.md#the-propose-verify-loop``).

Per step and request: the draft proposes ``k`` tokens after the anchor; the target runs
``[anchor, d_1 .. d_k]`` at positions ``p_anchor ..``; the verifier accepts ``a`` drafts and emits
a correction / bonus token, which is the next anchor at ``p_anchor + a + 1``. Only the verified
rows (old anchor + accepted drafts) become draft context, and both caches' valid lengths move to
``p_anchor + a + 1``: rejected rows stay in the caches as scratch that the next step overwrites.

The backend's caches are a pool of slots, one request each. A submitted request waits for a free
slot and is prefilled there one prompt chunk per step (so a long prompt never stalls the running
requests for long), samples its first token and joins the decoding requests at the next step. A
finished or cancelled request frees its slot at once and leaves its caches there: the next request
goes to the free slot that holds the longest beginning of its prompt and prefills only the rest
(``prefix_cache.py``), else to the free slot left longest ago, cleared. Each request has its own
``max_new_tokens``, temperature, top-p, top-k, min-p, penalties, seed (its own
``torch.Generator``), stop strings, log-probabilities and speculation on or off. How many drafts a
step verifies is the verification policy's cap, below the confidence cut: a fixed one by the
number of busy slots (``draft_schedule.py``), or the one that the requests' own acceptance and the
measured call costs say pays best (``adaptive.py``).

A backend either runs steps on any slots (ONNX Runtime: one sequence per call), and then requests
with speculation verify their drafts in one call and those without decode in another; or it is
``pooled`` (CUDA graphs captured on the whole pool's caches, the PyTorch reference's batched
steps): every decode step then runs every slot in order, one call for all, and a
slot without a decoding request is a frozen row that writes only scratch past its valid rows;
requests admitted together are prefilled together, on a block of consecutive slots.
``speculative.Decoding`` (a batch of prompts started together) is this loop with a pool of the
batch's size.

Greedy output is the target's own greedy output whatever else runs. A seeded request draws the
same numbers as alone while the schedule gives it the same cap: on a backend whose rows do not
depend on their neighbours (ONNX Runtime) its sampled output is then the same too.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

from runtime.backends.base import Backend, capacity_needed, torch_threads
from runtime.decoding.acceptance import Acceptance
from runtime.decoding.adaptive import AdaptiveVerification
from runtime.decoding.draft_schedule import DraftSchedule
from runtime.decoding.logprobs import TokenLogprob, token_logprobs
from runtime.decoding.params import Params
from runtime.decoding.penalties import Penalties
from runtime.decoding.prefill import insert_context, prefill_chunks
from runtime.decoding.prefix_cache import Held
from runtime.decoding.sampling import gumbel_noise, next_token, probabilities
from runtime.decoding.stats import PhaseTimes, SpecStats
from runtime.decoding.stop_strings import StopStrings
from runtime.decoding.verify import greedy_verify, rejection_verify


@dataclass(eq=False)
class Request:
    """One prompt's generation. ``token_ids`` grows as steps emit; ``finish_reason`` is set when
    it ends: ``"stop"`` (EOS or a stop string), ``"length"`` (``max_new_tokens``) or
    ``"cancelled"``. ``trace`` has a record per step: its anchor, the drafts it verified, how many
    were accepted and the tokens it emitted."""
    id: int
    prompt: list[int]
    params: Params
    token_ids: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=lambda: SpecStats(k=0))
    acceptance: Acceptance | None = None    # what adaptive verification plans its steps with
    finish_reason: str | None = None
    trace: list[dict] = field(default_factory=list)
    slot: int | None = None
    reused: int = 0               # prompt tokens its slot's caches held already (not prefilled)
    # between steps, on the backend's device: the draft context (its ``count`` rows, verified, from
    # position ``start``), the anchor and its position (= the target caches' valid length, also
    # while the prompt is prefilled)
    ctx: tuple[torch.Tensor, int, int] | None = None
    anchor: int = 0
    anchor_pos: int = 0
    state_slot: int = 0           # a hybrid target's state slot holding the state after the anchor
    generator: torch.Generator | None = None
    penalty: Penalties | None = None
    prefill: "Prefill | None" = None
    # with ``params.logprobs`` / ``prompt_logprobs``: one per generated token / prompt token after the first
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Prefill:
    """Requests admitted together, prefilled together one chunk per step (``prefill_chunks``)."""
    requests: list[Request]
    chunks: Iterator
    done: int = 0                 # prompt rows prefilled so far


class Scheduler:
    """``submit`` requests at any time; each ``step`` admits waiting requests into free slots,
    runs one decode step of the running ones and one prefill chunk of each prefilling group, and
    returns the requests that gained tokens (or ended) in it. ``pool`` slots (default: the
    engine's ``max_batch``); ``times`` sums the wall time of every step."""

    def __init__(self, backend: Backend, eos_token_ids=None, confidence_threshold: float | None = None,
                 draft_schedule: DraftSchedule | AdaptiveVerification | None = None, pool: int | None = None):
        self.backend, self.limits = backend, backend.limits
        self.schedule = draft_schedule or DraftSchedule.constant(self.limits.k)
        fixed = isinstance(self.schedule, DraftSchedule)
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
                          generator=torch.Generator(self.device).manual_seed(params.seed))
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
                self._prompt_scorer(group, scored) if scored else None, **self._at([r.slot for r in group]),
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
            aux, start, _ = held.pending
            count = request.reused - start
            insert_context(self.backend, aux[None, :count], torch.tensor([start], device=self.device),
                           torch.tensor([count], device=self.device),
                           torch.tensor([request.prompt[request.reused]], device=self.device), [slot])
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

    def _at(self, slots: list[int]) -> dict:
        """The ``slots`` argument of a call on ``slots``: none for the whole pool in order."""
        return {} if slots == list(range(len(self.slots))) else {"slots": slots}

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
            tokens.append(next_token(logits, p.temperature, p.top_p, request.generator, p.top_k, p.min_p))
        starts, counts, tokens = ctx_start.tolist(), ctx_count.tolist(), torch.stack(tokens).tolist()
        changed = []
        for b, request in enumerate(group):
            request.prefill = None
            if request.finished:      # cancelled while its group prefilled: the slot is free now
                self._release(request)
                continue
            # a copy: an engine backend's output buffers are reused by the next call of the same shape
            if request.params.speculative:
                request.ctx = (aux[b, :counts[b]].clone(), starts[b], counts[b])
            request.anchor_pos = len(request.prompt)
            self._emit(request, [tokens[b]], last_logits[b, None], anchor=None, drafts=[], accepted=0)
            changed.append(request)
        return changed

    def _decode(self, rows: list[Request | None], busy: int) -> list[Request]:
        """One propose / verify call, batch row ``b`` for ``rows[b]``: the running requests of one
        kind (with speculation or without) on their slots, or on a pooled backend every slot in
        order, where an empty or prefilling one is a frozen row. A call with speculation verifies
        at most the schedule's cap for ``busy`` occupied slots (a prefilling request's takes the
        machine's time too, and a request that ends and one that joins leave the cap as it was);
        at a cap of 0 it skips the draft and keeps the verified rows for the draft's next call,
        which comes when the rows fill one call (``limits.call_rows``) if not sooner."""
        batch, running = len(rows), [r is not None and r.prefill is None for r in rows]
        live = [b for b in range(batch) if running[b]]
        drafters = [b for b in live if rows[b].params.speculative]
        cap = self.schedule.cap([rows[b].acceptance for b in drafters], len(live) - len(drafters),
                                batch, busy) if drafters else 0
        drafting = bool(drafters) and (cap > 0 or any(rows[b].ctx[2] >= self.limits.call_rows
                                                      for b in drafters))
        at = self._at([r.slot for r in rows]) if not self.pooled else {}
        anchor = torch.tensor([r.anchor if on else 0 for r, on in zip(rows, running)], device=self.device)
        # a frozen row writes scratch from the slot's valid length (an empty one's: what it holds)
        anchor_pos = torch.tensor([len(self.held[b].tokens) if r is None else r.anchor_pos
                                   for b, r in enumerate(rows)], device=self.device)
        if drafting:
            drafts, q, limit = self._propose(rows, drafters, anchor, cap, at)
        else:
            drafts, q = torch.zeros(batch, self.limits.k, dtype=torch.long, device=self.device), None
            limit = torch.zeros(batch, dtype=torch.long, device=self.device)
        width = int(limit.max())
        block = torch.cat([anchor[:, None], drafts[:, :width]], 1)
        positions = torch.arange(width + 1, device=self.device).expand(block.shape)
        # a frozen row keeps its recurrent state where it is (state row -1: before the call)
        state_rows = torch.where(torch.tensor(running, device=self.device)[:, None], positions, -1)
        state_slot = torch.tensor([r.state_slot if on else self.held[b].state_slot if r is None else 0
                                   for b, (r, on) in enumerate(zip(rows, running))], device=self.device)
        with self.times.measure("verify"):
            logits, aux = self.backend.target_step(block, anchor_pos, positions, state_slot, state_rows, **at)
        accepted, emitted = self._verify(rows, live, drafts, q, limit, logits)
        # the step's one device -> host copy
        packed = torch.cat([accepted[:, None], limit[:, None], emitted, drafts[:, :width]], 1).tolist()
        changed = []
        for b in live:
            request, (a, n, *rest) = rows[b], packed[b]
            speculative = request.params.speculative
            verifying = drafting and cap > 0
            if not speculative or verifying:
                request.stats.record(a, n, cap)
            if speculative:
                request.stats.idle_steps += not verifying
                self.schedule.record(request.acceptance, cap if verifying else 0, n, a)
            if drafting and speculative:
                request.ctx = (aux[b, :a + 1].clone(), request.anchor_pos, a + 1)
            elif speculative:   # the draft has not read the rows before: they go in with this one
                pending, start, count = request.ctx
                request.ctx = (appended(pending, aux[b, 0]), start, count + 1)
            request.anchor_pos += a + 1
            request.state_slot = a
            self._emit(request, rest[:a + 1], logits[b], anchor=request.anchor, drafts=rest[width + 1:][:n],
                       accepted=a)
            changed.append(request)
        return changed

    def _propose(self, rows: list[Request | None], drafters: list[int], anchor: torch.Tensor, cap: int,
                 at: dict):
        """The drafters' ``k`` drafts (their own noise: none when greedy, or when no draft is
        verified), their distributions ``q`` and ``limit [B]``, how many each verifies: at most
        ``cap``, none from the first below the confidence threshold on, and none for another
        row (which inserts no context: ``ctx_count`` 0 at its valid length)."""
        limits, batch = self.limits, len(rows)
        first = rows[drafters[0]].ctx[0]
        width = max(rows[b].ctx[0].shape[0] for b in drafters)
        ctx_aux = first.new_zeros(batch, width, first.shape[-1])
        ctx_start = [self.held[b].draft_rows if r is None else r.anchor_pos for b, r in enumerate(rows)]
        ctx_count = [0] * batch
        shape = (limits.k, limits.draft_vocab_size)
        noise = torch.zeros(batch, *shape, device=self.device)
        temperatures = torch.ones(batch, device=self.device)
        for b in drafters:
            request = rows[b]
            rows_aux, ctx_start[b], ctx_count[b] = request.ctx
            ctx_aux[b, :rows_aux.shape[0]] = rows_aux
            if request.params.temperature > 0:
                temperatures[b] = request.params.temperature
                if cap > 0:
                    noise[b] = gumbel_noise(shape, request.generator)
        with self.times.measure("draft"):
            drafts, q = self.backend.draft_step(ctx_aux, torch.tensor(ctx_start, device=self.device),
                                                torch.tensor(ctx_count, device=self.device), anchor,
                                                temperatures, noise, **at)
        proposing = set(drafters)
        limit = torch.tensor([cap if b in proposing else 0 for b in range(batch)], device=self.device)
        if self.threshold > 0 and cap > 0:   # the cut past the cap changes nothing: not read
            limit = torch.minimum(limit, confident_drafts(q[:, :cap], self.threshold))
        return drafts, q, limit

    def _verify(self, rows: list[Request | None], live: list[int], drafts: torch.Tensor,
                q: torch.Tensor | None, limit: torch.Tensor, logits: torch.Tensor):
        """``accepted [B]`` and ``emitted [B, width + 1]``: the greedy rows by the target's argmax,
        the sampled ones by rejection sampling (one token from ``p`` where a row verifies no
        draft), each with ``k + 1`` numbers from its own generator whatever the call's width."""
        width = logits.shape[1] - 1
        penalized = [b for b in live if rows[b].penalty is not None]
        if penalized:
            logits = logits.clone()
            for b in penalized:
                logits[b] = rows[b].penalty(logits[b], drafts[b])
        accepted, emitted = greedy_verify(drafts[:, :width], logits, limit)
        sampled = [b for b in live if rows[b].params.temperature > 0]
        if not sampled:
            return accepted, emitted
        index = torch.tensor(sampled, device=self.device)
        uniform = torch.stack([torch.rand(self.limits.k + 1, generator=rows[b].generator, device=self.device)
                               for b in sampled])
        by_options: dict[tuple, list[int]] = {}
        for i, b in enumerate(sampled):
            p = rows[b].params
            by_options.setdefault((p.temperature, p.top_p, p.top_k, p.min_p), []).append(i)
        probs = torch.empty(len(sampled), width + 1, logits.shape[-1], device=self.device)
        for options, members in by_options.items():
            probs[members] = probabilities(logits[index[members]], *options)
        q_rows = q[index, :width] if q is not None else probs[:, :0]
        accepted[index], emitted[index] = rejection_verify(drafts[index, :width], q_rows, probs, uniform,
                                                           limit[index])
        return accepted, emitted

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
        if request.ctx is not None:
            pending, draft_rows = request.ctx, request.ctx[1]
        else:   # without drafts: what its slot's draft context held, as far as it reused it
            pending, draft_rows = None, min(before.draft_rows, request.reused)
        return Held(sequence[:valid], draft_rows, pending, request.state_slot, next(self.releases))


def extend(out: list[int], tokens: list[int], max_new_tokens: int, eos: set[int],
           stop: StopStrings | None) -> str | None:
    """Append ``tokens`` to ``out`` up to the first EOS (kept), the token that completes a stop
    string, or ``max_new_tokens`` in all; the reason the sequence ended there (``"stop"`` or
    ``"length"``), or None while it goes on."""
    for token in tokens[: max_new_tokens - len(out)]:
        out.append(token)
        if token in eos or (stop is not None and stop.reached(out)):
            return "stop"
    return "length" if len(out) >= max_new_tokens else None


def appended(rows: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """``rows [n, D]`` and ``row [D]`` after them, in the storage of ``rows`` where it has room past
    them (twice the rows where not): a request taking target-only steps adds a context row a step
    without copying those before (``torch.cat`` copied up to a call's rows, each step)."""
    count = rows.shape[0]
    storage = rows.untyped_storage()
    room = storage.nbytes() // (rows.element_size() * rows.shape[1])
    if rows.storage_offset() or not rows.is_contiguous() or room <= count:
        grown = rows.new_empty(max(2 * count, 16), rows.shape[1])
        grown[:count] = rows
        rows = grown[:count]
    whole = rows.as_strided((count + 1, rows.shape[1]), rows.stride())
    whole[count] = row
    return whole


def confident_drafts(q: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[B]``: how many of each sequence's drafts come before the first whose distribution's top
    probability (``q [B, k, V]``) is below ``threshold``. The rule reads the draft's distributions,
    never the token drawn from them, so sampling stays exact, and greedy output is the target's
    whatever is cut."""
    return (q.amax(-1) >= threshold).cumprod(dim=1).sum(dim=1)


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

