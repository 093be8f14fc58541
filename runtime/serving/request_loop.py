"""The scheduler thread that every front end shares (``runtime.serve``'s OpenAI-compatible
server, a Triton Inference Server model, Ray Serve replicas): one thread owns the backend and the
``Batcher`` and steps it while any request is in it; front ends hand it ``Job``s through a queue
and receive each step's tokens through the job's ``send``. Requests join and leave the running
batch as they come (``runtime/decoding/scheduler.py``).
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from runtime.decoding.batcher import Batcher
from runtime.decoding.draft_schedule import DraftSchedule, adaptive
from runtime.decoding.params import Params
from runtime.decoding.request import Request
from runtime.serving.metrics import Metrics
from runtime.serving.request_error import RequestError


@dataclass
class Job:
    """A request on its way through the scheduler thread. ``send`` is called on that thread with
    each event: the request's token ids so far after every step that changed them, ``None`` once
    it has ended, or a ``RequestError``; a front end hands them to its own thread or loop."""
    prompt: list[int]
    params: Params
    send: Callable[[object], None]
    request: Request | None = None
    arrived: float = field(default_factory=time.perf_counter)
    first_token: float | None = None    # when its first token came
    sent: int = 0                       # tokens reported so far


SHUTTING_DOWN = RequestError(503, "the server is shutting down", kind="unavailable_error")


class RequestLoop:
    """The scheduler thread: ``submit`` a job, ``cancel`` it; it steps while there is work, until
    ``stop``. Without a ``draft_schedule`` it verifies adaptively, with the call costs measured on
    this machine first (``draft_schedule.adaptive``), and says so on stderr."""

    def __init__(self, backend, max_queue: int,
                 draft_schedule: DraftSchedule | None = None):
        if draft_schedule is None and backend.limits.k:
            begin = time.perf_counter()
            draft_schedule = adaptive(backend)
            print(f"adaptive verification (call costs measured in {time.perf_counter() - begin:.1f} s; "
                  f"--draft-schedule N fixes the drafts per step)", file=sys.stderr, flush=True)
        self.batcher = Batcher(backend, draft_schedule=draft_schedule)
        scheduler = self.batcher.scheduler
        self.inbox: queue.Queue = queue.Queue()
        self.max_queue = max_queue
        self.jobs: dict[int, Job] = {}
        self.metrics = Metrics(running=lambda: scheduler.occupied,
                               waiting=lambda: len(scheduler.waiting) + self.inbox.qsize())
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.stopping:
            raise SHUTTING_DOWN
        # what the inbox holds is waiting too, less what the free slots will take at the next step
        scheduler = self.batcher.scheduler
        free = len(scheduler.slots) - scheduler.occupied
        if len(scheduler.waiting) + self.inbox.qsize() - free >= self.max_queue:
            raise RequestError(429, f"the queue is full ({self.max_queue} requests waiting for a "
                                    f"slot, --max-queue); retry later", kind="rate_limit_error")
        self.inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        self.inbox.put(("cancel", job))

    def stop(self) -> None:
        """End every request, running or waiting, with 503 at the next step boundary and end the
        thread (``join`` it before the process exits: a backend call must not outlive it)."""
        self.stopping = True
        self.inbox.put(("stop", None))

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def _loop(self) -> None:
        while True:
            busy = self.batcher.busy
            try:
                while True:
                    command, job = self.inbox.get(block=not busy, timeout=None if not busy else 0)
                    if command == "stop":
                        self._fail(SHUTTING_DOWN)
                        return
                    self._handle(command, job)
                    busy = True
            except queue.Empty:
                pass
            if self.batcher.busy:
                begin = time.perf_counter()
                try:
                    changed = self.batcher.step()
                except Exception as err:   # the backend failed: every request in it ends with a 500
                    self._fail(RequestError(500, f"the engine failed: {type(err).__name__}: {err}",
                                            kind="server_error"))
                    continue
                self.metrics.step.observe(time.perf_counter() - begin)
                for request in changed:
                    self._report(self.jobs[request.id], request)

    def _fail(self, error: RequestError) -> None:
        """End every request in the scheduler with ``error``."""
        for job in list(self.jobs.values()):
            self.batcher.cancel(job.request)
            job.send(error)
        self.jobs.clear()

    def _handle(self, command: str, job: Job) -> None:
        if command == "submit":
            try:
                job.request = self.batcher.submit(job.prompt, job.params, name="prompt")
            except ValueError as err:
                job.send(RequestError(400, str(err)))
                return
            self.jobs[job.request.id] = job
        elif job.request is not None and not job.request.finished:
            self.batcher.cancel(job.request)
            self._report(job, job.request)

    def _report(self, job: Job, request: Request) -> None:
        now = time.perf_counter()
        self.metrics.generation_tokens.inc(len(request.token_ids) - job.sent)
        job.sent = len(request.token_ids)
        if job.first_token is None and request.token_ids:
            job.first_token = now
            self.metrics.first_token(len(request.prompt), now - job.arrived)
        if request.finished:   # counted before the reply, which a client may follow with /metrics
            self.jobs.pop(request.id, None)
            self.metrics.ended(request, now - job.arrived,
                               None if job.first_token is None else now - job.first_token)
        job.send(list(request.token_ids))
        if request.finished:
            job.send(None)
