"""How many drafts a step verifies as the batch fills (vLLM's and TensorRT-LLM's draft-length
schedule): ``1:4,3:2,6:0`` verifies at most 4 drafts per request while 1 or 2 of the pool's
slots are busy, 2 from 3 on, none (target-only steps) from 6 on.

A verify row is nearly free while the target is bound by reading its weights, and costs its full
compute once the batch's rows make it compute-bound; so the rows worth verifying shrink as slots
fill. ``measure`` picks the schedule for the machine it runs on: it times the backend's calls at
every batch size and runs a short greedy generation for the draft's acceptance, then chooses per
batch size the cap with the most expected tokens per second. The confidence cut still applies
below the cap.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .backend import Backend

# the acceptance the schedule plans with is measured on these (chat-templated by the caller): not
# the benchmarks' held-out prompts, and shipped in the package rather than read from data/
CALIBRATION_PROMPTS = ("Explain step by step how a bicycle stays upright while it moves.",
                       "Tom has 3 boxes of 12 pencils and gives away 7 pencils. How many are left?")


@dataclass(frozen=True)
class DraftSchedule:
    """``steps``: ``(busy, drafts)`` pairs, ``busy`` ascending from 1: from ``busy`` occupied
    slots on, at most ``drafts`` drafts per request per step."""
    steps: tuple[tuple[int, int], ...]

    @classmethod
    def constant(cls, drafts: int) -> "DraftSchedule":
        return cls(((1, drafts),))

    @classmethod
    def parse(cls, text: str, k: int, flag: str = "--draft-schedule") -> "DraftSchedule":
        """``"1:4,3:2,6:0"`` (or one number: that cap at every load), refused in one line."""
        expected = (f"expected BUSY:DRAFTS pairs with BUSY rising from 1 and DRAFTS 0 .. {k} "
                    f"(the engine's k), e.g. 1:{k},4:{k // 2},8:0, or one number")
        try:
            pairs = [(1, int(text))] if ":" not in text else [
                tuple(int(n) for n in part.split(":")) for part in text.split(",")]
        except ValueError:
            pairs = None
        if (not pairs or any(len(p) != 2 for p in pairs) or pairs[0][0] != 1
                or any(b <= a for (a, _), (b, _) in zip(pairs, pairs[1:]))
                or any(not 0 <= d <= k for _, d in pairs)):
            raise ValueError(f"{flag} {text!r}: {expected}")
        return cls(tuple(pairs))

    def drafts(self, busy: int) -> int:
        """The cap while ``busy`` slots are occupied."""
        return next(d for b, d in reversed(self.steps) if b <= busy)

    def __str__(self) -> str:
        return ",".join(f"{b}:{d}" for b, d in self.steps)


@dataclass(frozen=True)
class Costs:
    """Seconds per call at each batch size ``b`` (index ``b - 1``): the draft step, and the target
    step on one row and on ``k + 1`` rows per sequence (in between: linear in the rows)."""
    draft: list[float]
    target_one: list[float]
    target_full: list[float]

    def target(self, batch: int, rows: float, k: int) -> float:
        one, full = self.target_one[batch - 1], self.target_full[batch - 1]
        return one + (full - one) * (rows - 1) / k if k else one


def choose(costs: Costs, trace: list[tuple[int, int]], k: int) -> DraftSchedule:
    """Per batch size, the cap with the most expected tokens per second (the smaller on a tie).

    ``trace``: ``(proposed, accepted)`` per verify step of one sequence, proposed after the
    confidence cut. Capped at ``c``, a step emits ``1 + min(c, accepted)`` tokens, and a batch of
    ``b`` verifies its widest request's ``min(c, proposed)`` drafts: for independent requests,
    ``sum over m = 1 .. c of P(some request proposes at least m)``."""
    steps = len(trace)
    caps = []
    for batch in range(1, len(costs.draft) + 1):
        def rate(cap: int) -> float:
            tokens = batch * sum(1 + min(cap, a) for _, a in trace) / steps
            width = sum(1 - (sum(n < m for n, _ in trace) / steps) ** batch for m in range(1, cap + 1))
            seconds = (costs.draft[batch - 1] if cap else 0.0) + costs.target(batch, 1 + width, k)
            return tokens / seconds
        caps.append(max(range(k + 1), key=lambda cap: (rate(cap), -cap)))
    steps_ = [(1, caps[0])] + [(b + 1, c) for b, c in enumerate(caps) if b and c != caps[b - 1]]
    return DraftSchedule(tuple(steps_))


def measure(backend: Backend, prompts: list[list[int]], max_new_tokens: int = 48,
            repeats: int = 3) -> tuple[DraftSchedule, Costs, list[tuple[int, int]]]:
    """The schedule for this machine: each call's time (the fastest of ``repeats``, after one
    untimed call) at every batch size, and the acceptance of a greedy generation from each of
    ``prompts`` alone. The backend's caches hold junk afterwards: start or clear them."""
    from .speculative import generate

    limits = backend.limits
    room = limits.capacity - limits.lookahead       # a small engine's cache: shorter runs
    max_new_tokens = min(max_new_tokens, room // 2)
    trace = []
    for prompt in prompts:
        result = generate(backend, [prompt[-(room - max_new_tokens):]], max_new_tokens=max_new_tokens,
                          eos_token_ids=())
        trace += [(len(r["drafts"]), r["accepted"]) for r in result.trace if r["step"]]
    backend.start(limits.max_batch)
    k, device = limits.k, backend.device
    position = min(256, limits.capacity - limits.lookahead - 1)

    def fastest(call) -> float:
        call()
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            call()
            times.append(time.perf_counter() - begin)
        return min(times)

    draft, one, full = [], [], []
    with torch.inference_mode():
        for batch in range(1, limits.max_batch + 1):
            slots = list(range(batch))
            start = torch.full((batch,), position, device=device)

            def target(rows: int):
                ids = torch.zeros(batch, rows, dtype=torch.long, device=device)
                at = torch.arange(rows, device=device).expand(batch, rows)
                return backend.target_step(ids, start, at, torch.zeros_like(start), at, slots=slots)

            one.append(fastest(lambda: target(1)))
            full.append(fastest(lambda: target(k + 1)))
            aux = target(k + 1)[1].clone()
            count = torch.full((batch,), k + 1, device=device)
            noise = torch.zeros(batch, k, limits.draft_vocab_size, device=device)
            draft.append(fastest(lambda: backend.draft_step(
                aux, start, count, start * 0, torch.ones(batch, device=device), noise, slots=slots)))
    costs = Costs(draft, one, full)
    return choose(costs, trace, k), costs, trace
