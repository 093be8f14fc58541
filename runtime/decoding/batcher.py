"""Continuous batching on a backend: each ``step`` is the scheduler's plan (``scheduler.py``),
run on the backend (``executor.py``), its outcome applied by the scheduler (vLLM's engine core:
``schedule``, ``execute_model``, ``update_from_output``)."""
from __future__ import annotations

from runtime.backends.base import Backend, torch_threads
from runtime.decoding.draft_schedule import DraftSchedule
from runtime.decoding.executor import Executor
from runtime.decoding.params import Params
from runtime.decoding.request import Request
from runtime.decoding.scheduler import Scheduler
from runtime.decoding.stats import PhaseTimes


class Batcher:
    """``submit`` requests at any time; each ``step`` admits waiting requests into free slots,
    runs one decode step of the decoding ones and one prefill chunk of each prefilling group, and
    returns the requests that gained tokens (or ended) in it. ``pool`` slots (default: the
    engine's ``max_batch``); ``times`` sums the wall time of every step. The options are the
    ``Scheduler``'s and the ``Executor``'s."""

    def __init__(self, backend: Backend, eos_token_ids=None, confidence_threshold: float | None = None,
                 draft_schedule: DraftSchedule | None = None, pool: int | None = None):
        self.backend = backend
        self.scheduler = Scheduler(backend.limits, pooled=backend.pooled, device=backend.device,
                                   eos_token_ids=eos_token_ids, draft_schedule=draft_schedule, pool=pool)
        self.executor = Executor(backend, confidence_threshold)
        self.times = PhaseTimes()
        self.started = False       # the caches are emptied at the first step, not before

    def submit(self, prompt: list[int], params: Params | None = None, name: str = "prompt") -> Request:
        """Queue ``prompt``; refused in one line (naming ``name``) when it cannot fit a slot."""
        return self.scheduler.submit(prompt, params, name)

    def cancel(self, request: Request) -> None:
        """End ``request`` now (``Scheduler.cancel``)."""
        self.scheduler.cancel(request)

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    def run(self) -> None:
        """Step until every submitted request has ended."""
        while self.busy:
            self.step()

    def step(self) -> list[Request]:
        """One step boundary: admit, decode the decoding requests, prefill a chunk of the others."""
        with torch_threads(self.backend.hints.host_threads), self.times.measure("total"):
            if not self.started:
                self.backend.start(len(self.scheduler.slots))
                self.started = True
            plan = self.scheduler.schedule()
            return self.scheduler.update(plan, self.executor.run(plan, self.times))
