"""Runs a step's ``Plan`` on a backend and returns its ``Outcome`` (``plan.py``): the admitted
slots cleared (or their pending draft context inserted), the decode calls (``step.py``), a chunk
of each prefilling group (``prefill.py``) and, after a prompt's last chunk, its first token. It
keeps no request state but each group's chunks to come; the scheduler keeps the rest."""
from __future__ import annotations

from functools import partial
from typing import Iterator

import torch

from runtime.backends.base import Backend
from runtime.decoding.logprobs import TokenLogprob, token_logprobs
from runtime.decoding.plan import Admission, Chunk, Decoded, Outcome, Plan, Prefilled
from runtime.decoding.prefill import insert_context, prefill_chunks
from runtime.decoding.request import DraftContext, Prefill
from runtime.decoding.sampling import next_token
from runtime.decoding.stats import PhaseTimes
from runtime.decoding.step import Call, speculative_step


class Executor:
    """``run`` plans on ``backend``; a step's drafts are cut at the first whose top probability is
    below ``confidence_threshold`` (default: the engine's, ``limits.confidence_threshold``)."""

    def __init__(self, backend: Backend, confidence_threshold: float | None = None):
        self.backend = backend
        self.threshold = (backend.limits.confidence_threshold if confidence_threshold is None
                          else confidence_threshold)
        if not 0 <= self.threshold <= 1:
            raise ValueError(f"confidence_threshold {self.threshold}: expected 0 (verify every draft) .. 1")
        # each prefilling group's chunks to come, and the prompt log-probabilities its last chunk scored
        self.prefills: dict[Prefill, tuple[Iterator, list[list[TokenLogprob]]]] = {}

    def run(self, plan: Plan, times: PhaseTimes) -> Outcome:
        for admission in plan.admitted:
            self._admit(admission)
        decoded = [self._decode(call, times) for call in plan.calls]
        prefilled = [self._chunk(chunk, times) for chunk in plan.chunks]
        # a group that is done, or that the scheduler let go (all of it cancelled), is not kept
        self.prefills = {c.group: self.prefills[c.group] for c in plan.chunks if not c.last}
        return Outcome(decoded, prefilled)

    def _admit(self, admission: Admission) -> None:
        if admission.clear:
            self.backend.clear(admission.slot)
        if admission.pending is not None:
            request, pending = admission.request, admission.pending
            on_device = partial(torch.tensor, device=self.backend.device)
            insert_context(self.backend, pending.rows[None], on_device([pending.start]),
                           on_device([pending.count]), on_device([request.prompt[request.reused]]),
                           [admission.slot])

    def _decode(self, call: Call, times: PhaseTimes) -> dict[int, Decoded]:
        """One speculative step of ``call``; of each live row, the target's rows it keeps (copies:
        an engine backend's output buffers are reused by the next call of the same shape)."""
        step = speculative_step(self.backend, call, self.threshold, times)
        decoded = {}
        for b in call.live:
            request, verdict = call.requests[b], step.verdicts[b]
            kept, p = verdict.accepted + 1, request.params
            decoded[b] = Decoded(verdict, step.taps[b, :kept].clone() if p.speculative else None,
                                 step.logits[b, :kept].clone() if p.logprobs is not None else None)
        return decoded

    def _chunk(self, chunk: Chunk, times: PhaseTimes) -> Prefilled:
        """One chunk of a group's prompts; after the last, each one's first token."""
        group = chunk.group
        if group not in self.prefills:
            self.prefills[group] = self._start(chunk)
        chunks, scored = self.prefills[group]
        with times.measure("prefill"):
            done = next(chunks)
        prefilled = Prefilled([list(s) for s in scored])
        for s in scored:
            s.clear()
        assert (done is None) != chunk.last, "the scheduler plans the chunk a prompt ends in as last"
        if done is None:
            return prefilled
        last_logits, (aux, ctx_start, ctx_count) = done
        tokens = []
        for b, request in enumerate(group.requests):
            p, logits = request.params, last_logits[b]
            if request.penalty is not None:
                logits = request.penalty(logits[None])[0]
            noise = request.noise.rows(0, 1)[0] if request.noise is not None else None
            tokens.append(next_token(logits, p.temperature, p.top_p, noise, p.top_k, p.min_p))
        starts, counts = ctx_start.tolist(), ctx_count.tolist()
        prefilled.tokens, prefilled.logits = torch.stack(tokens).tolist(), last_logits
        # a copy: an engine backend's output buffers are reused by the next call of the same shape
        prefilled.contexts = [DraftContext(aux[b, :counts[b]].clone(), starts[b]) if r.params.speculative
                              else None for b, r in enumerate(group.requests)]
        return prefilled

    def _start(self, chunk: Chunk) -> tuple[Iterator, list[list[TokenLogprob]]]:
        """A group's chunks (``prefill_chunks``), and where each request that asked for its prompt's
        log-probabilities gets those that a chunk's rows predict."""
        requests, device = chunk.group.requests, self.backend.device
        prompts = [r.prompt[r.reused:] for r in requests]
        scored: list[list[TokenLogprob]] = [[] for _ in requests]

        def score(begin: int, logits: torch.Tensor) -> None:
            for b, request in enumerate(requests):
                if request.params.prompt_logprobs is not None:   # its prompt is all prefilled (reused 0)
                    tokens = request.prompt[begin + 1:begin + 1 + logits.shape[1]]
                    scored[b] += token_logprobs(logits[b], tokens, request.params.prompt_logprobs)

        scoring = any(r.params.prompt_logprobs is not None for r in requests)
        chunks = prefill_chunks(self.backend, prompts, torch.tensor(list(map(len, prompts)), device=device),
                                any(r.params.speculative for r in requests), score if scoring else None,
                                slots=chunk.slots,
                                offsets=torch.tensor([r.reused for r in requests], device=device),
                                state_slot=torch.tensor([r.state_slot for r in requests], device=device))
        return chunks, scored
