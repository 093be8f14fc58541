"""The propose / verify loop, for a batch of ragged prompts on any backend
(``docs/dspark.md#the-propose-verify-loop``).

Per step and sequence: the draft proposes ``k`` tokens after the anchor; the target runs
``[anchor, d_1 .. d_k]`` at positions ``p_anchor ..``; the verifier accepts ``a`` drafts and emits
a correction / bonus token, which is the next anchor at ``p_anchor + a + 1``. Only the verified
rows (old anchor + accepted drafts) become draft context, and both caches' valid lengths move to
``p_anchor + a + 1``: rejected rows stay in the caches as scratch that the next step overwrites.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

import torch

from .backend import Backend, capacity_needed
from .params import Params
from .repetition import RepetitionPenalty
from .sampling import gumbel_noise, next_token, probabilities
from .stats import SpecStats
from .stop_strings import StopStrings
from .verify import greedy_verify, rejection_verify


@dataclass
class PhaseTimes:
    """Wall time per phase, seconds. ``host`` is everything outside the backend calls."""
    prefill: float = 0.0
    draft: float = 0.0
    verify: float = 0.0
    total: float = 0.0

    @property
    def host(self) -> float:
        return max(0.0, self.total - self.prefill - self.draft - self.verify)

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        """Add the wall time of the ``with`` body to ``phase``."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, phase, getattr(self, phase) + time.perf_counter() - begin)


@dataclass
class GenerationResult:
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


@dataclass
class Proposal:
    """A step's drafts ``[B, width]`` (none without speculation), their distributions ``q`` and
    how many each sequence proposes (``limit [B]``, at most ``width``)."""
    drafts: torch.Tensor
    q: torch.Tensor | None
    limit: torch.Tensor


@dataclass
class Verdict:
    """What the target made of a proposal: drafts ``accepted [B]``, the tokens ``emitted
    [B, width + 1]`` (accepted drafts, then the correction / bonus token), and the aux rows of the
    verified block, the next draft step's context."""
    accepted: torch.Tensor
    emitted: torch.Tensor
    aux: torch.Tensor


class HostRow(NamedTuple):
    """One sequence's row of a step's single device -> host copy."""
    accepted: int
    proposed: int
    emitted: list[int]
    drafts: list[int]
    anchor: int


class StepInputs(NamedTuple):
    """What every step of a batch feeds the same, made once when the batch starts."""
    noise_shape: tuple[int, int, int]      # [B, k, V_d]
    zero_noise: torch.Tensor | None        # greedy drafting: the draft's argmax
    temperatures: torch.Tensor             # [B]
    every_draft: torch.Tensor              # [B] = k: the limit when no confidence cut applies
    no_drafts: Proposal                    # target-only decoding's proposal


@dataclass
class Cursor:
    """Where each sequence stands between steps: on the backend's device, the draft context
    (``ctx_aux`` rows, from position ``ctx_start``, the first ``ctx_count`` of them verified), the
    ``anchor`` token and its position ``anchor_pos`` (= each target cache's valid length) and the
    slot of a hybrid target's recurrent state (the state after the accepted rows; its verify
    step keeps the state after each row in the slot of that row's number); on the host, the same
    positions (``positions``), which the next step's copy back starts from."""
    ctx_aux: torch.Tensor
    ctx_start: torch.Tensor
    ctx_count: torch.Tensor
    anchor: torch.Tensor
    anchor_pos: torch.Tensor
    positions: list[int]
    state_slot: torch.Tensor      # a hybrid target's slot holding each sequence's recurrent state


class Decoding:
    """One batch being generated. Iterate it to receive each step's ``Emission``s as they are
    accepted; ``result`` holds everything generated so far, also after an interruption.

    A sequence stops at its first EOS (kept in the output), at the token that completes one of
    the ``stop`` strings, or after ``max_new_tokens``.
    ``temperature == 0`` is greedy: the output is exactly the target's own greedy output.
    Otherwise it is distributed as the target's sampling distribution (with ``top_k`` and
    ``top_p``, as ``transformers`` applies them).
    ``confidence_threshold`` (default: the backend's, which an engine records at build; 0 verifies
    all ``k``) cuts each step's drafts at the first whose top draft probability is below it, so
    the target spends no verify rows on drafts that are unlikely to be accepted. ``names`` label the
    prompts in errors (``prompt 1``, ... by default)."""

    def __init__(self, backend: Backend, prompts: list[list[int]], *, max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                 eos_token_ids=(),
                 speculative: bool = True, confidence_threshold: float | None = None,
                 names: list[str] | None = None, stop: StopStrings | None = None,
                 repetition_penalty: float = 1.0):
        if not prompts:
            raise ValueError("no prompts: expected at least one")
        Params(max_new_tokens, temperature, top_p, top_k).check()
        if not 0 < repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty {repetition_penalty}: expected a finite number above 0 "
                             f"(1: off)")
        if confidence_threshold is None:
            confidence_threshold = backend.limits.confidence_threshold
        if not 0 <= confidence_threshold <= 1:
            raise ValueError(f"confidence_threshold {confidence_threshold}: expected 0 (verify every "
                             f"draft) .. 1")
        self.confidence_threshold = confidence_threshold
        self.speculative = speculative and backend.limits.k > 0
        check_capacity(backend, prompts, max_new_tokens, self.speculative,
                        names or [f"prompt {i + 1}" for i in range(len(prompts))])
        self.backend, self.prompts = backend, prompts
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = (max_new_tokens, temperature,
                                                                         top_p, top_k)
        self.greedy = temperature == 0
        # tensors live where the backend computes; one host copy per step brings the tokens back
        self.device = backend.device
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.eos, self.stop = set(eos_token_ids), stop
        self.penalty = (RepetitionPenalty(repetition_penalty, prompts, backend.limits.vocab_size, self.device)
                        if repetition_penalty != 1 else None)
        self.result = GenerationResult([[] for _ in prompts],
                                       SpecStats(k=backend.limits.k if self.speculative else 0))

    def _emit(self, b: int, tokens: list[int], record: dict) -> Emission:
        """Append ``tokens`` to sequence ``b`` up to its first EOS, stop string or its budget."""
        out = self.result.token_ids[b]
        before = len(out)
        finished = extend(out, tokens, self.max_new_tokens, self.eos, self.stop) is not None
        if self.penalty is not None:
            self.penalty.record(b, out[before:])
        self.result.trace.append({"sequence": b, **record, "emitted": out[before:]})
        return Emission(b, out[before:], finished)

    def __iter__(self) -> Iterator[list[Emission]]:
        steps = self._steps()
        while True:
            with torch_threads(self.backend.host_threads):
                emissions = next(steps, None)
            if emissions is None:
                return
            yield emissions

    def _steps(self) -> Iterator[list[Emission]]:
        """Prefill, then per step: propose, verify, advance. Each yield hands the consumer a step's
        emissions; the time it keeps them is not counted in ``times.total``."""
        times = self.result.times
        resumed = time.perf_counter()
        cursor, inputs, emissions = self._start()
        live = [e.sequence for e in emissions if not e.finished]
        times.total += time.perf_counter() - resumed
        yield emissions
        step = 0
        while live:
            resumed = time.perf_counter()
            step += 1
            proposal = self._propose(cursor, inputs, live)
            verdict = self._verify(cursor, proposal)
            emissions = self._advance(cursor, proposal, verdict, live, step)
            live = [e.sequence for e in emissions if not e.finished]
            times.total += time.perf_counter() - resumed
            yield emissions

    def _start(self) -> tuple[Cursor, StepInputs, list[Emission]]:
        """Prefill every prompt and sample the first anchors (the step-0 emissions)."""
        batch, limits, device = len(self.prompts), self.backend.limits, self.device
        noise_shape = (batch, limits.k, limits.draft_vocab_size)
        drafting_argmax = self.speculative and self.greedy
        none = torch.zeros(batch, dtype=torch.long, device=device)
        inputs = StepInputs(
            noise_shape, torch.zeros(noise_shape, device=device) if drafting_argmax else None,
            torch.full((batch,), 1.0 if self.greedy else self.temperature, device=device),
            torch.full((batch,), limits.k, device=device),
            Proposal(torch.zeros(batch, 0, dtype=torch.long, device=device), None, none))
        lengths = torch.tensor([len(p) for p in self.prompts], device=device)
        self.backend.start(len(self.prompts))
        with self.result.times.measure("prefill"):
            last_logits, context = _prefill(self.backend, self.prompts, lengths, self.speculative)
        if self.penalty is not None:
            last_logits = self.penalty(last_logits[:, None])[:, 0]
        anchor = next_token(last_logits, self.temperature, self.top_p, self.generator, self.top_k)
        emissions = [self._emit(b, [token], {"step": 0, "anchor": None, "drafts": [], "accepted": 0})
                     for b, token in enumerate(anchor.tolist())]
        return (Cursor(*context, anchor, lengths.clone(), lengths.tolist(), torch.zeros_like(lengths)),
                inputs, emissions)

    def _propose(self, cursor: Cursor, inputs: StepInputs, live: list[int]) -> Proposal:
        """The draft's ``k`` tokens after each anchor (zero noise when greedy: its argmax), cut
        at the confidence threshold; no drafts without speculation."""
        if not self.speculative:
            return inputs.no_drafts
        noise = inputs.zero_noise if self.greedy else gumbel_noise(inputs.noise_shape, self.generator)
        with self.result.times.measure("draft"):
            drafts, q = self.backend.draft_step(cursor.ctx_aux, cursor.ctx_start, cursor.ctx_count,
                                                cursor.anchor, inputs.temperatures, noise)
        if self.confidence_threshold > 0:
            return self._confident(drafts, q, live)
        return Proposal(drafts, q, inputs.every_draft)

    def _verify(self, cursor: Cursor, proposal: Proposal) -> Verdict:
        """The target on ``[anchor, drafts]`` at the anchors' positions, every row's logits; then
        the longest agreeing prefix (greedy) or rejection sampling against the draft's ``q``."""
        block = torch.cat([cursor.anchor[:, None], proposal.drafts], 1)
        rows = torch.arange(block.shape[1], device=self.device).expand(block.shape)
        with self.result.times.measure("verify"):
            logits, aux = self.backend.target_step(block, cursor.anchor_pos, rows, cursor.state_slot, rows)
        if self.penalty is not None:
            logits = self.penalty(logits, proposal.drafts)
        if not self.speculative:
            emitted = next_token(logits, self.temperature, self.top_p, self.generator, self.top_k)
            return Verdict(proposal.limit, emitted, aux)
        if self.greedy:
            accepted, emitted = greedy_verify(proposal.drafts, logits, proposal.limit)
        else:
            p = probabilities(logits, self.temperature, self.top_p, self.top_k)
            accepted, emitted = rejection_verify(proposal.drafts, proposal.q, p, self.generator,
                                                 proposal.limit)
        return Verdict(accepted, emitted, aux)

    def _advance(self, cursor: Cursor, proposal: Proposal, verdict: Verdict, live: list[int],
                 step: int) -> list[Emission]:
        """Emit each live sequence's accepted drafts and correction / bonus token, and move the
        cursor past them: the verified rows (old anchor + accepted drafts) become the draft's
        context and the emitted token the next anchor. A finished sequence stays in the batch
        frozen (same anchor and position, no new context), so it never writes past the rows its
        prompt and budget were given."""
        width = verdict.emitted.shape[1]
        # the step's only device -> host copy
        packed = torch.cat([verdict.accepted[:, None], proposal.limit[:, None], verdict.emitted,
                            proposal.drafts, cursor.anchor[:, None]], 1).tolist()
        rows = [HostRow(r[0], r[1], r[2:2 + width], r[2 + width:-1], r[-1]) for r in packed]
        counts, anchors = [0] * len(rows), [row.anchor for row in rows]
        emissions = []
        for b in live:
            row = rows[b]
            self.result.stats.record(row.accepted)
            emission = self._emit(b, row.emitted[:row.accepted + 1], {
                "step": step, "anchor": row.anchor, "drafts": row.drafts[:row.proposed],
                "accepted": row.accepted})
            emissions.append(emission)
            if not emission.finished:
                counts[b] = row.accepted + 1
                anchors[b] = row.emitted[row.accepted]
                cursor.positions[b] += row.accepted + 1
        cursor.ctx_aux, cursor.ctx_start, cursor.state_slot = verdict.aux, cursor.anchor_pos, verdict.accepted
        cursor.ctx_count, cursor.anchor, cursor.anchor_pos = torch.tensor(
            [counts, anchors, cursor.positions], device=self.device).unbind()
        return emissions

    def _confident(self, drafts: torch.Tensor, q: torch.Tensor, live: list[int]) -> Proposal:
        """Each sequence's drafts before the first whose distribution's top probability is below
        ``confidence_threshold`` (``limit [B]`` of them); the batch verifies the widest live one.
        The rule reads the draft's distributions, never the token drawn from them, so sampling
        stays exact, and greedy output is the target's whatever is cut."""
        limit = confident_drafts(q, self.confidence_threshold)
        width = int(limit[live].max())
        return Proposal(drafts[:, :width], q[:, :width], limit)


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


def confident_drafts(q: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[B]``: how many of each sequence's drafts come before the first whose distribution's top
    probability (``q [B, k, V]``) is below ``threshold``."""
    return (q.amax(-1) >= threshold).cumprod(dim=1).sum(dim=1)


@contextmanager
def torch_threads(count: int | None):
    """Run the loop's own torch work on ``count`` threads (``None``: as configured), and restore
    the setting whenever the loop hands control back to its consumer."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_capacity(backend: Backend, prompts: list[list[int]], max_new_tokens: int, speculative: bool,
                    names: list[str]) -> None:
    """Refuse the first prompt that is empty or whose tokens, ``max_new_tokens`` and the rows a
    step may write past them do not fit the KV cache, naming it; every prompt is checked before
    any runs."""
    limits = backend.limits
    for name, prompt in zip(names, prompts):
        if not prompt:
            raise ValueError(f"{name}: no tokens; expected at least one")
        needed = capacity_needed(len(prompt), max_new_tokens, limits if speculative else None)
        if needed > limits.capacity:
            raise ValueError(f"{name} has {len(prompt)} tokens: with max_new_tokens {max_new_tokens} "
                             f"it needs {needed} KV-cache rows; the capacity is "
                             f"{limits.capacity} (build --max-seq-len)")


def generate(backend: Backend, prompts: list[list[int]], **options) -> GenerationResult:
    """Run a ``Decoding`` to the end (options as there) and return its result."""
    decoding = Decoding(backend, prompts, **options)
    for _ in decoding:
        pass
    return decoding.result


def _prefill(backend: Backend, prompts, lengths, speculative: bool):
    """``prefill_chunks`` run to its end: its last-position logits and the first draft context."""
    *_, last = prefill_chunks(backend, prompts, lengths, speculative)
    return last


def prefill_chunks(backend: Backend, prompts, lengths, speculative: bool, slots: list[int] | None = None):
    """Run the prompts through the target in chunks of at most ``backend.limits.max_prompt_chunk`` rows
    (right-padded: rows past a prompt's end are scratch; a prompt that ended in an earlier chunk
    writes its padding from its own end, so that no call writes more than a chunk past a
    sequence's valid rows, which a sliding layer's ring relies on). Every chunk but the last is inserted into
    the draft's context right away (its proposals are discarded); the last one is returned as the
    first draft step's context. Yields None after each chunk but the last, then each prompt's
    last-position logits and that context (so that a scheduler can run other steps between
    chunks). Batch row ``b`` runs on the backend's slot ``slots[b]`` (default: slot ``b``).

    Each chunk asks the target for one row of logits per prompt: its last row where the prompt
    ends in the chunk, a row that is not read otherwise (clamped into the chunk). A hybrid
    target keeps the recurrent state after the same row in slot 0, or the state before the chunk
    (row -1) for a prompt that ended in an earlier one: padding never advances it."""
    batch, longest, device = len(prompts), max(map(len, prompts)), lengths.device
    padded = torch.zeros(batch, longest, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        padded[b, : len(prompt)] = torch.tensor(prompt)
    padded = padded.to(device)
    chunk = backend.limits.max_prompt_chunk
    last_logits, slot = None, torch.zeros_like(lengths)
    at = {} if slots is None else {"slots": slots}
    for begin in range(0, longest, chunk):
        ids = padded[:, begin:begin + chunk]
        last_row = lengths - 1 - begin
        here = (last_row >= 0) & (last_row < ids.shape[1])
        logits, aux = backend.target_step(ids, lengths.clamp(max=begin),
                                          last_row.clamp(0, ids.shape[1] - 1)[:, None], slot,
                                          last_row.clamp(-1, ids.shape[1] - 1)[:, None], **at)
        # a copy: an engine backend reuses its output buffer for the next chunk of this shape
        picked = logits[:, 0].clone()
        last_logits = picked if last_logits is None else torch.where(here[:, None], picked, last_logits)
        context = (aux, lengths.clamp(max=begin), (lengths - begin).clamp(0, ids.shape[1]))
        if speculative and begin + chunk < longest:
            next_tokens = padded[:, begin + chunk]
            backend.draft_step(*context, next_tokens, torch.ones(batch, device=device),
                               torch.zeros(batch, backend.limits.k, backend.limits.draft_vocab_size,
                                           device=device), **at)
        if begin + chunk < longest:
            yield None
    yield last_logits, context
