"""One speculative step (``docs/dspark.md#the-propose-verify-loop``): propose, verify, accept.

Per row: the draft proposes ``k`` tokens after the anchor, reading first the context rows it has
not seen (``DraftContext``); the target runs ``[anchor, d_1 .. d_w]`` at positions
``anchor_pos ..``; the verifier accepts ``a`` drafts and emits a correction / bonus token, which
is the next anchor at ``anchor_pos + a + 1``. A row verifies at most the call's cap and none from
the first draft below the confidence cut on. Rejected rows stay in the caches as scratch that the
next step overwrites. Which requests share a call, their slots and their cap are the scheduler's
(``scheduler.py``), and so is what a request keeps of the step (``Scheduler.update``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.backends.base import Backend
from runtime.decoding.request import Request
from runtime.decoding.sampling import scores
from runtime.decoding.stats import PhaseTimes
from runtime.decoding.verify import accept


@dataclass
class Call:
    """A decode call as the scheduler feeds it. Row ``b`` runs ``requests[b]``, or is a frozen row
    (``None``: a pooled slot without a decoding request, which writes only scratch past its valid
    rows and keeps its recurrent state)."""
    requests: list[Request | None]
    anchor: list[int]             # [B] the token each row runs from
    anchor_pos: list[int]         # [B] its position: the target caches' valid length
    state_slot: list[int]         # [B] a hybrid target's state slot holding the state before it
    context_start: list[int]      # [B] where a row without a draft context has its draft's go on
    cap: int                      # the most drafts a row verifies; 0: a target-only step
    drafting: bool                # the draft runs: cap > 0, or a row's context rows fill a call
    slots: list[int] | None       # the pool's slot of each row; None: the whole pool, in order

    @property
    def live(self) -> list[int]:
        return [b for b, r in enumerate(self.requests) if r is not None]

    @property
    def drafters(self) -> list[int]:
        return [b for b, r in enumerate(self.requests) if r is not None and r.params.speculative]


@dataclass
class Proposal:
    drafts: torch.Tensor          # [B, k]
    limit: torch.Tensor           # [B] how many of them each row verifies


@dataclass
class Verdict:
    """What one row's step verified, on the host."""
    accepted: int                 # drafts accepted
    verified: int                 # drafts verified (below the cap and the confidence cut)
    emitted: list[int]            # the accepted drafts and the correction / bonus token after them
    drafts: list[int]             # the drafts verified


@dataclass
class Step:
    verdicts: list[Verdict]       # [B]
    logits: torch.Tensor          # [B, w + 1, V] the target's rows: row j predicts the token after d_j
    taps: torch.Tensor            # [B, w + 1, D] the target's taps of those rows: the draft's context


def speculative_step(backend: Backend, call: Call, threshold: float, times: PhaseTimes) -> Step:
    """Propose, verify and accept on every row of ``call``."""
    device, k = backend.device, backend.limits.k
    batch = len(call.requests)
    anchor = torch.tensor(call.anchor, device=device)
    if call.drafting:
        proposal = propose(backend, call, anchor, threshold, times)
    else:
        proposal = Proposal(torch.zeros(batch, k, dtype=torch.long, device=device),
                            torch.zeros(batch, dtype=torch.long, device=device))
    width = int(proposal.limit.max())
    block = torch.cat([anchor[:, None], proposal.drafts[:, :width]], 1)
    positions = torch.arange(width + 1, device=device).expand(block.shape)
    # a frozen row keeps its recurrent state where it is (state row -1: before the call)
    running = torch.tensor([r is not None for r in call.requests], device=device)
    state_rows = torch.where(running[:, None], positions, -1)
    with times.measure("verify"):
        logits, taps = backend.target_step(block, torch.tensor(call.anchor_pos, device=device), positions,
                                           torch.tensor(call.state_slot, device=device), state_rows,
                                           slots=call.slots)
    accepted, emitted = verify(call, proposal, logits)
    # the step's one device -> host copy
    verdicts = [Verdict(a, n, emitted_row[:a + 1], drafts_row[:n]) for (a,), (n,), emitted_row, drafts_row
                in to_host(accepted[:, None], proposal.limit[:, None], emitted, proposal.drafts[:, :width])]
    return Step(verdicts, logits, taps)


def propose(backend: Backend, call: Call, anchor: torch.Tensor, threshold: float,
            times: PhaseTimes) -> Proposal:
    """The drafters' ``k`` drafts (a sampled request's with the noise of the positions they
    propose, ``noise.py``; none when no draft is verified) and how many each verifies: at most the
    cap, none from the first below the confidence ``threshold`` on, and none for another row
    (which inserts no context: a count of 0 at its ``context_start``)."""
    device, limits, batch = backend.device, backend.limits, len(call.requests)
    drafters = call.drafters
    contexts = {b: call.requests[b].context for b in drafters}
    first = contexts[drafters[0]].rows
    aux = first.new_zeros(batch, max(c.count for c in contexts.values()), first.shape[-1])
    start, count = list(call.context_start), [0] * batch
    noise = torch.zeros(batch, limits.k, limits.vocab_size, device=device)
    temperatures = torch.ones(batch, device=device)
    for b, context in contexts.items():
        request = call.requests[b]
        aux[b, :context.count], start[b], count[b] = context.rows, context.start, context.count
        if request.params.temperature > 0:
            temperatures[b] = request.params.temperature
            if call.cap > 0:
                noise[b] = request.noise.rows(len(request.token_ids), limits.k)
    with times.measure("draft"):
        drafts, q = backend.draft_step(aux, torch.tensor(start, device=device),
                                       torch.tensor(count, device=device), anchor, temperatures, noise,
                                       slots=call.slots)
    limit = torch.tensor([call.cap if b in contexts else 0 for b in range(batch)], device=device)
    if threshold > 0 and call.cap > 0:   # the cut past the cap changes nothing: not read
        limit = torch.minimum(limit, confident_drafts(q[:, :call.cap], threshold))
    return Proposal(drafts, limit)


def verify(call: Call, proposal: Proposal, logits: torch.Tensor):
    """``accepted [B]`` and ``emitted [B, w + 1]``: the drafts equal to the target's tokens, which
    are its argmax on greedy rows and on sampled ones the argmax of its scores with the noise of
    the positions they predict (``noise.py``): the target's own sample, whatever was drafted."""
    width, drafts, requests = logits.shape[1] - 1, proposal.drafts, call.requests
    live = call.live
    if any(requests[b].penalty is not None or requests[b].params.temperature > 0 for b in live):
        logits = logits.to(torch.float32, copy=True)    # the scores are float32
    for b in live:
        request, p = requests[b], requests[b].params
        if request.penalty is not None:
            logits[b] = request.penalty(logits[b], drafts[b])
        if p.temperature > 0:
            noise = request.noise.rows(len(request.token_ids), width + 1)
            logits[b] = scores(logits[b], noise, p.temperature, p.top_p, p.top_k, p.min_p)
    return accept(drafts[:, :width], logits, proposal.limit)


def confident_drafts(q: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[B]``: how many of each sequence's drafts come before the first whose distribution's top
    probability (``q [B, k, V]``) is below ``threshold``. The rule reads the draft's distributions,
    never the token drawn from them, so sampling stays exact, and greedy output is the target's
    whatever is cut."""
    return (q.amax(-1) >= threshold).cumprod(dim=1).sum(dim=1)


def to_host(*columns: torch.Tensor) -> list[list[list[int]]]:
    """``columns [B, n_i]`` as ``[B][i]`` lists of ints, in one device -> host copy."""
    widths = [c.shape[1] for c in columns]
    rows = torch.cat(columns, 1).tolist()
    bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
    return [[row[begin:end] for begin, end in zip(bounds, bounds[1:])] for row in rows]
