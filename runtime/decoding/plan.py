"""What one step runs and what it gives back, as plain records: the scheduler writes a ``Plan``
(``Scheduler.schedule``), the executor runs it on a backend and returns an ``Outcome``
(``Executor.run``), and the scheduler applies that in one place (``Scheduler.update``). A test
writes an ``Outcome`` by hand to drive the scheduler without a model (vLLM's ``SchedulerOutput`` /
``ModelRunnerOutput``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.decoding.logprobs import TokenLogprob
from runtime.decoding.request import DraftContext, Prefill, Request
from runtime.decoding.step import Call, Verdict


@dataclass
class Admission:
    """A waiting request placed in free slot ``slot``. Its caches start empty (``clear``), or hold
    the first ``request.reused`` rows of its prompt; then ``pending`` are the draft context rows of
    those that the slot's draft has not read yet, inserted before its prefill."""
    request: Request
    slot: int
    clear: bool
    pending: DraftContext | None = None


@dataclass
class Chunk:
    """The next ``max_prompt_chunk`` rows of a prefilling group's prompts, from ``group.done`` on,
    on the pool's ``slots`` (None: the whole pool, in order); ``last``: their prompts end in it,
    and each request samples its first token."""
    group: Prefill
    last: bool
    slots: list[int] | None


@dataclass
class Plan:
    """One step, run in this order: the admissions, the decode calls (on a pooled backend one of
    every slot, else one of the requests with speculation and one of those without), a chunk of
    each prefilling group."""
    admitted: list[Admission]
    calls: list[Call]
    chunks: list[Chunk]

    @property
    def empty(self) -> bool:
        return not (self.admitted or self.calls or self.chunks)


@dataclass
class Decoded:
    """What a decode call's row gives its request."""
    verdict: Verdict
    taps: torch.Tensor             # [accepted + 1, D] the target's taps of the rows it keeps
    logits: torch.Tensor | None    # [accepted + 1, V] the rows that predicted its tokens, if it asks logprobs


@dataclass
class Prefilled:
    """What a chunk gives its group's requests, by their place in it."""
    prompt_logprobs: list[list[TokenLogprob]]   # of the prompt tokens the chunk's rows predict, if asked
    tokens: list[int] | None = None             # after the last chunk: each one's first token,
    logits: torch.Tensor | None = None          # [B, V] the prompt rows that predicted them,
    contexts: list[DraftContext | None] | None = None   # the draft context rows (with speculation)


@dataclass
class Outcome:
    """A ``Plan``'s results: per call, its live rows' (``Call.live``); per chunk, its ``Prefilled``."""
    decoded: list[dict[int, Decoded]]
    prefilled: list[Prefilled]
