"""Continuous batching: requests come and go while the others decode (``docs/dspark.md``'s loop,
per request).

The backend's caches are a pool of ``limits.max_batch`` slots. A submitted request waits for a
free slot, which is cleared and prefilled one prompt chunk per step (so a long prompt never
stalls the running requests for long), samples its first token and joins the decoding requests at
the next step. A finished or cancelled request frees its slot at once. Each request has its own
``max_new_tokens``, temperature, top-p, top-k, seed (its own ``torch.Generator``), stop strings and
speculation on or off; requests with speculation verify their drafts in one target call, those
without decode in another. How many drafts a step verifies follows the number of busy slots
(``draft_schedule.py``), below the confidence cut.

Greedy output is the target's own greedy output whatever else runs, and a seeded request draws
the same numbers as alone while the schedule gives it the same cap: on a backend whose rows do
not depend on their neighbours (ONNX Runtime: one sequence per call) its sampled output is then
the same too.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch
import torch.nn.functional as F

from .backend import Backend
from .draft_schedule import DraftSchedule
from .params import Params
from .sampling import gumbel_noise, next_token, probabilities
from .speculative import check_capacity, confident_drafts, extend, prefill_chunks, torch_threads
from .stats import SpecStats
from .verify import greedy_verify, rejection_verify


@dataclass
class Request:
    """One prompt's generation. ``token_ids`` grows as steps emit; ``finish_reason`` is set when
    it ends: ``"stop"`` (EOS or a stop string), ``"length"`` (``max_new_tokens``) or
    ``"cancelled"``."""
    id: int
    prompt: list[int]
    params: Params
    token_ids: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=lambda: SpecStats(k=0))
    proposed: int = 0             # drafts it verified (after the confidence cut), summed over steps
    finish_reason: str | None = None
    slot: int | None = None
    # between steps, on the backend's device: the draft context rows (from ``ctx_start``, the
    # first ``ctx_count`` verified), the anchor and its position (= the target caches' length)
    ctx: tuple[torch.Tensor, int, int] | None = None
    anchor: int = 0
    anchor_pos: int = 0
    state_slot: int = 0           # a hybrid target's state slot holding the state after the anchor
    generator: torch.Generator | None = None
    prefill: Iterator | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    """``submit`` requests at any time; each ``step`` admits waiting requests into free slots,
    runs one decode step of the running ones and one prefill chunk of each prefilling one, and
    returns the requests that gained tokens (or ended) in it."""

    def __init__(self, backend: Backend, eos_token_ids=None, confidence_threshold: float | None = None,
                 draft_schedule: DraftSchedule | None = None):
        self.backend, self.limits = backend, backend.limits
        self.schedule = draft_schedule or DraftSchedule.constant(self.limits.k)
        if any(d > self.limits.k for _, d in self.schedule.steps):
            raise ValueError(f"draft schedule {self.schedule}: the engine proposes {self.limits.k} "
                             f"drafts per step (k)")
        self.eos = set(self.limits.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.threshold = (self.limits.confidence_threshold if confidence_threshold is None
                          else confidence_threshold)
        self.slots: list[Request | None] = [None] * self.limits.max_batch
        self.waiting: deque[Request] = deque()
        self.ids = itertools.count()
        self.device = backend.device
        backend.start(self.limits.max_batch)

    def submit(self, prompt: list[int], params: Params | None = None, name: str = "prompt") -> Request:
        """Queue ``prompt``; refused in one line (naming ``name``) when it cannot fit a slot."""
        params = params or Params()
        params.check()
        speculative = params.speculative and self.limits.k > 0
        check_capacity(self.backend, [prompt], params.max_new_tokens, speculative, [name])
        request = Request(next(self.ids), list(prompt), replace(params, speculative=speculative),
                          stats=SpecStats(k=self.limits.k if speculative else 0),
                          generator=torch.Generator(self.device).manual_seed(params.seed))
        self.waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """End ``request`` now; its slot is free for the next step."""
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
        return bool(self.waiting) or any(r is not None for r in self.slots)

    def run(self) -> None:
        """Step until every submitted request has ended."""
        while self.busy:
            self.step()

    def step(self) -> list[Request]:
        """One step boundary: admit, decode the running requests, prefill a chunk of the others."""
        with torch_threads(self.backend.host_threads):
            return self._step()

    def _step(self) -> list[Request]:
        for slot, occupant in enumerate(self.slots):
            if occupant is None and self.waiting:
                self._admit(self.waiting.popleft(), slot)
        running = [r for r in self.slots if r is not None and r.prefill is None]
        prefilling = [r for r in self.slots if r is not None and r.prefill is not None]
        changed, busy = [], self.occupied
        for group in ([r for r in running if r.params.speculative],
                      [r for r in running if not r.params.speculative]):
            if group:
                changed += self._decode(group, busy)
        for request in prefilling:
            if self._prefill_chunk(request):
                changed.append(request)
        return changed

    def _admit(self, request: Request, slot: int) -> None:
        request.slot = slot
        self.slots[slot] = request
        self.backend.clear(slot)
        lengths = torch.tensor([len(request.prompt)], device=self.device)
        request.prefill = prefill_chunks(self.backend, [request.prompt], lengths,
                                         request.params.speculative, slots=[slot])

    def _prefill_chunk(self, request: Request) -> bool:
        """One chunk of ``request``'s prompt; after the last, its first token (True)."""
        done = next(request.prefill)
        if done is None:
            return False
        request.prefill = None
        last_logits, (aux, ctx_start, ctx_count) = done
        p = request.params
        token = int(next_token(last_logits, p.temperature, p.top_p, request.generator, p.top_k)[0])
        # a copy: an engine backend's output buffers are reused by the next call of the same shape
        request.ctx = (aux[0].clone(), int(ctx_start[0]), int(ctx_count[0]))
        request.anchor_pos = len(request.prompt)
        self._emit(request, [token])
        return True

    def _decode(self, group: list[Request], busy: int) -> list[Request]:
        """One propose / verify step of ``group`` (all with speculation, or all without). A
        speculative group verifies at most the schedule's cap for ``busy`` occupied slots (a
        prefilling request's takes the machine's time too, and a request that ends and one that
        joins leave the cap as it was); at a cap of 0 it skips the draft and keeps the verified
        rows for the draft's next call, which comes when the rows fill one call
        (``limits.call_rows``) if not sooner."""
        slots = [r.slot for r in group]
        anchor = torch.tensor([r.anchor for r in group], device=self.device)
        anchor_pos = torch.tensor([r.anchor_pos for r in group], device=self.device)
        speculative = group[0].params.speculative
        cap = self.schedule.drafts(busy) if speculative else 0
        drafting = speculative and (cap > 0 or any(r.ctx[2] >= self.limits.call_rows for r in group))
        if drafting:
            drafts, q, limit = self._propose(group, anchor, slots, cap)
        else:
            drafts = torch.zeros(len(group), 0, dtype=torch.long, device=self.device)
        block = torch.cat([anchor[:, None], drafts], 1)
        rows = torch.arange(block.shape[1], device=self.device).expand(block.shape)
        state_slot = torch.tensor([r.state_slot for r in group], device=self.device)
        logits, aux = self.backend.target_step(block, anchor_pos, rows, state_slot, rows, slots=slots)
        for b, request in enumerate(group):
            p = request.params
            if cap == 0:
                accepted, emitted = 0, next_token(logits[b], p.temperature, p.top_p, request.generator,
                                                  p.top_k).tolist()
            else:   # its own drafts only, so that its random draws do not depend on the group's
                n = int(limit[b])
                request.proposed += n
                mine, rows_logits = drafts[b:b + 1, :n], logits[b:b + 1, :n + 1]
                if p.temperature == 0:
                    a, e = greedy_verify(mine, rows_logits)
                else:
                    probs = probabilities(rows_logits, p.temperature, p.top_p, p.top_k)
                    a, e = rejection_verify(mine, q[b:b + 1, :n], probs, request.generator)
                accepted, emitted = int(a[0]), e[0].tolist()
                request.stats.record(accepted)
            if drafting or not speculative:
                request.ctx = (aux[b].clone(), request.anchor_pos, accepted + 1)
            else:   # the draft has not read the rows before: they go in with this one
                before, start, count = request.ctx
                request.ctx = (torch.cat([before[:count], aux[b][:1]]), start, count + 1)
            request.anchor_pos += accepted + 1
            request.state_slot = accepted
            self._emit(request, emitted[:accepted + 1])
        return group

    def _propose(self, group: list[Request], anchor: torch.Tensor, slots: list[int], cap: int):
        """Each request's drafts (its own noise: none when greedy), ``limit [B]`` of them: at most
        ``cap``, and none from the first below the confidence threshold on; the group verifies the
        widest."""
        limits = self.limits
        width = max(r.ctx[0].shape[0] for r in group)
        ctx_aux = torch.stack([F.pad(r.ctx[0], (0, 0, 0, width - r.ctx[0].shape[0])) for r in group])
        ctx_start = torch.tensor([r.ctx[1] for r in group], device=self.device)
        ctx_count = torch.tensor([r.ctx[2] for r in group], device=self.device)
        shape = (limits.k, limits.draft_vocab_size)
        noise = torch.stack([torch.zeros(shape, device=self.device) if r.params.temperature == 0
                             else gumbel_noise(shape, r.generator) for r in group])
        temperatures = torch.tensor([r.params.temperature or 1.0 for r in group], device=self.device)
        drafts, q = self.backend.draft_step(ctx_aux, ctx_start, ctx_count, anchor, temperatures, noise,
                                            slots=slots)
        limit = torch.full((len(group),), limits.k, device=self.device)
        if self.threshold > 0:
            limit = confident_drafts(q, self.threshold)
        limit = limit.clamp(max=cap)
        cut = int(limit.max())
        return drafts[:, :cut], q[:, :cut], limit

    def _emit(self, request: Request, tokens: list[int]) -> None:
        """Append ``tokens`` up to the first EOS, stop string or the budget; end the request there."""
        p = request.params
        request.finish_reason = extend(request.token_ids, tokens, p.max_new_tokens, self.eos, p.stop)
        if request.finished:
            self._release(request)
        else:
            request.anchor = request.token_ids[-1]

    def _release(self, request: Request) -> None:
        if request.slot is not None and self.slots[request.slot] is request:
            self.slots[request.slot] = None
        request.prefill = None
