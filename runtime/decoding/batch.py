"""A batch of prompts started together: continuous batching (``batcher.py``) with a pool of the
batch's size, every prompt submitted at once (``docs/dspark.md#the-propose-verify-loop``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from runtime.backends.base import Backend
from runtime.decoding.batcher import Batcher
from runtime.decoding.params import Params
from runtime.decoding.stats import PhaseTimes, SpecStats
from runtime.decoding.stop_strings import StopStrings


@dataclass
class DecodingResult:
    """What a ``Decoding`` generated, as token ids (``Generator``'s ``Generation`` adds the texts)."""
    token_ids: list[list[int]]                    # generated ids per prompt (prompt excluded)
    stats: SpecStats
    times: PhaseTimes = field(default_factory=PhaseTimes)
    trace: list[dict] = field(default_factory=list)   # one record per step and sequence


@dataclass
class Emission:
    """Tokens that one sequence gained in one step (after EOS / budget truncation)."""
    sequence: int
    tokens: list[int]
    finished: bool


class Decoding:
    """One batch being generated. Iterate it to receive each step's ``Emission``s as they are
    accepted; ``result`` holds everything generated so far, also after an interruption.

    A sequence stops at its first EOS (kept in the output), at the token that completes one of
    the ``stop`` strings, or after ``max_new_tokens``.
    ``temperature == 0`` is greedy: the output is exactly the target's own greedy output.
    Otherwise it is the target's own sample (with ``top_k`` and ``top_p``, as ``transformers``
    applies them) for prompt ``i``'s seed, ``seed + i`` (``noise.py``): the same tokens with
    speculation or without, at any cap.
    ``confidence_threshold`` (default: the backend's, which an engine records at build; 0 verifies
    all ``k``) cuts each step's drafts at the first whose top draft probability is below it, so
    the target spends no verify rows on drafts that are unlikely to be accepted. ``draft_schedule``
    caps the drafts a step verifies (default: the engine's ``k`` at every step; a
    ``LoadSchedule``, or ``AdaptiveSchedule``: ``Generator.draft_schedule``). ``names`` label the
    prompts in errors (``prompt 1``, ... by default); every prompt is checked before any runs.
    ``after``: a finished ``Decoding`` whose batcher (its caches and options) this one goes on
    with, so that a prompt beginning with a sequence it left prefills only the rest (a chat's next
    turn)."""

    def __init__(self, backend: Backend, prompts: list[list[int]], *, max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                 eos_token_ids=(),
                 speculative: bool = True, confidence_threshold: float | None = None,
                 names: list[str] | None = None, stop: StopStrings | None = None,
                 repetition_penalty: float = 1.0, after: "Decoding | None" = None,
                 draft_schedule=None):
        if not prompts:
            raise ValueError("no prompts: expected at least one")
        self.prompts, self.stop = prompts, stop
        if (after is not None and len(prompts) <= len(after.batcher.scheduler.slots)
                and not after.batcher.busy):
            self.batcher = after.batcher
        else:
            self.batcher = Batcher(backend, eos_token_ids, confidence_threshold, draft_schedule,
                                   pool=len(prompts))
        self.times = self.batcher.times = PhaseTimes()     # this batch's steps only
        names = names or [f"prompt {i + 1}" for i in range(len(prompts))]
        self.requests = [self.batcher.submit(prompt, Params(max_new_tokens, temperature, top_p, top_k,
                                                            seed + i, speculative, stop,
                                                            repetition_penalty), name)
                         for i, (prompt, name) in enumerate(zip(prompts, names))]
        self.k = backend.limits.k if self.requests[0].params.speculative else 0

    @property
    def result(self) -> DecodingResult:
        stats = SpecStats(k=self.k)
        for request in self.requests:
            stats.merge(request.stats)
        trace = sorted(({"sequence": b, **record} for b, r in enumerate(self.requests) for record in r.trace),
                       key=lambda record: record["step"])
        return DecodingResult([r.token_ids for r in self.requests], stats, self.times, trace)

    def __iter__(self) -> Iterator[list[Emission]]:
        """Each step's emissions (a step that only prefilled a chunk has none and is not yielded);
        the time the consumer keeps them is not counted in ``result.times.total``."""
        emitted = [0] * len(self.requests)
        index = {request.id: b for b, request in enumerate(self.requests)}
        while self.batcher.busy:
            changed = self.batcher.step()
            if not changed:
                continue
            emissions = []
            for request in sorted(changed, key=lambda r: r.id):
                b = index[request.id]
                emissions.append(Emission(b, request.token_ids[emitted[b]:], request.finished))
                emitted[b] = len(request.token_ids)
            yield emissions


def generate(backend: Backend, prompts: list[list[int]], **options) -> DecodingResult:
    """Run a ``Decoding`` to the end (options as there) and return its result."""
    decoding = Decoding(backend, prompts, **options)
    for _ in decoding:
        pass
    return decoding.result
