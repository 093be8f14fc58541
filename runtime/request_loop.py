"""The scheduler thread that every front end shares (``runtime.serve``'s OpenAI-compatible
server, a Triton Inference Server model, Ray Serve replicas): one thread owns the backend and the
``Scheduler`` and steps it while any request is in it; front ends hand it ``Job``s through a queue
and receive each step's tokens through the job's ``send``. Requests join and leave the running
batch as they come (``runtime/scheduler.py``).
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .draft_schedule import DraftSchedule, measure
from .generator import Generator
from .params import Params
from .scheduler import Request, Scheduler
from .serve_metrics import Metrics
from .stop_strings import StopStrings


class RequestError(Exception):
    """A request the server refuses: its HTTP status, OpenAI error type and one-line message."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


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


class Engine:
    """The scheduler thread: ``submit`` a job, ``cancel`` it; it steps while there is work. Without
    a ``draft_schedule`` it measures one on this machine first (``draft_schedule.measure``) and
    says which on stderr."""

    def __init__(self, backend, max_queue: int, draft_schedule: DraftSchedule | None = None):
        if draft_schedule is None and backend.limits.k:
            begin = time.perf_counter()
            draft_schedule = measure(backend)[0]
            print(f"draft schedule {draft_schedule} (busy slots:drafts, measured in "
                  f"{time.perf_counter() - begin:.1f} s; --draft-schedule sets it)", file=sys.stderr,
                  flush=True)
        self.scheduler = Scheduler(backend, draft_schedule=draft_schedule)
        self.inbox: queue.Queue = queue.Queue()
        self.max_queue = max_queue
        self.jobs: dict[int, Job] = {}
        self.metrics = Metrics(running=lambda: self.scheduler.occupied,
                               waiting=lambda: len(self.scheduler.waiting) + self.inbox.qsize())
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        # what the inbox holds is waiting too, less what the free slots will take at the next step
        free = len(self.scheduler.slots) - self.scheduler.occupied
        if len(self.scheduler.waiting) + self.inbox.qsize() - free >= self.max_queue:
            raise RequestError(429, f"the queue is full ({self.max_queue} requests waiting for a "
                                    f"slot, --max-queue); retry later", kind="rate_limit_error")
        self.inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        self.inbox.put(("cancel", job))

    def _loop(self) -> None:
        while True:
            busy = self.scheduler.busy
            try:
                while True:
                    self._handle(*self.inbox.get(block=not busy, timeout=None if not busy else 0))
                    busy = True
            except queue.Empty:
                pass
            if self.scheduler.busy:
                begin = time.perf_counter()
                try:
                    changed = self.scheduler.step()
                except Exception as err:   # the backend failed: every request in it ends with a 500
                    self._fail(err)
                    continue
                self.metrics.step.observe(time.perf_counter() - begin)
                for request in changed:
                    self._report(self.jobs[request.id], request)

    def _fail(self, err: Exception) -> None:
        error = RequestError(500, f"the engine failed: {type(err).__name__}: {err}", kind="server_error")
        for job in list(self.jobs.values()):
            self.scheduler.cancel(job.request)
            job.send(error)
        self.jobs.clear()

    def _handle(self, command: str, job: Job) -> None:
        if command == "submit":
            try:
                job.request = self.scheduler.submit(job.prompt, job.params, name="prompt")
            except ValueError as err:
                job.send(RequestError(400, str(err)))
                return
            self.jobs[job.request.id] = job
        elif job.request is not None and not job.request.finished:
            self.scheduler.cancel(job.request)
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


def body_field(body: dict, name: str, kind, default, check=None, expected: str = ""):
    """``body[name]`` of type ``kind`` (``default`` when absent or null), refused in one line."""
    value = body.get(name, default)
    if value is None:
        value = default
    kinds = (int, float) if kind is float else kind
    wrong = not isinstance(value, kinds) or (isinstance(value, bool) and kind is not bool)
    if value is not default and wrong:
        raise RequestError(400, f"'{name}': {value!r} is not {expected or kind.__name__}", name)
    if check is not None and not check(value):
        raise RequestError(400, f"'{name}': {value!r}; expected {expected}", name)
    return value


def request_params(body: dict, prompt: list[int], generator: Generator) -> Params:
    """A request's options from its fields (OpenAI's names: ``max_tokens``, ``temperature``,
    ``top_p``, ``seed``, ``stop``, and ``speculative``), each refused in one line. ``max_tokens``
    defaults to what the KV cache has left after the prompt (as llama-server's
    ``n_predict = -1`` does, bounded)."""
    limits = generator.backend.limits
    stop = body_field(body, "stop", (str, list), [], expected="a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, f"'stop': {stop!r}; expected non-empty strings", "stop")
    room = max(1, limits.capacity - len(prompt) - limits.lookahead)
    return Params(
        max_new_tokens=body_field(body, "max_tokens", int, room, lambda v: v >= 1,
                                  "an integer of at least 1"),
        temperature=body_field(body, "temperature", float, 1.0, lambda v: 0 <= v <= 2, "0 .. 2"),
        top_p=body_field(body, "top_p", float, 1.0, lambda v: 0 < v <= 1, "more than 0 and at most 1"),
        seed=body_field(body, "seed", int, 0),
        # an extension (llama-server has its per-request ``speculative.n_max``): false decodes
        # this request with the target alone
        speculative=body_field(body, "speculative", bool, True),
        stop=StopStrings(stop, generator.decode) if stop else None)
