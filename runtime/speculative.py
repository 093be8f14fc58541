"""The propose / verify loop (design.md §5), for a batch of ragged prompts on any backend.

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
from typing import Iterator

import torch

from .sampling import gumbel_noise, next_token, probabilities
from .stats import SpecStats
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


class Decoding:
    """One batch being generated. Iterate it to receive each step's ``Emission``s as they are
    accepted; ``result`` holds everything generated so far, also after an interruption.

    A sequence stops at its first EOS (kept in the output) or after ``max_new_tokens``.
    ``temperature == 0`` is greedy: the output is exactly the target's own greedy output.
    Otherwise it is distributed as the target's sampling distribution (with ``top_p``).
    ``confidence_threshold`` (default: the backend's, which an engine records at build; 0 verifies
    all ``k``) cuts each step's drafts at the first whose top draft probability is below it, so
    the target spends no verify rows on drafts that are unlikely to be accepted. ``names`` label the
    prompts in errors (``prompt 1``, ... by default)."""

    def __init__(self, backend, prompts: list[list[int]], *, max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, eos_token_ids=(),
                 speculative: bool = True, confidence_threshold: float | None = None,
                 names: list[str] | None = None):
        if not prompts:
            raise ValueError("no prompts: expected at least one")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {max_new_tokens}: expected at least 1")
        if not 0 <= temperature < math.inf:
            raise ValueError(f"temperature {temperature}: expected a finite number, at least 0 "
                             f"(0 is greedy)")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p {top_p}: expected more than 0 and at most 1")
        if confidence_threshold is None:
            confidence_threshold = getattr(backend, "confidence_threshold", 0.0)
        if not 0 <= confidence_threshold <= 1:
            raise ValueError(f"confidence_threshold {confidence_threshold}: expected 0 (verify every "
                             f"draft) .. 1")
        self.confidence_threshold = confidence_threshold
        self.speculative = speculative and backend.k > 0
        _check_capacity(backend, prompts, max_new_tokens, self.speculative,
                        names or [f"prompt {i + 1}" for i in range(len(prompts))])
        self.backend, self.prompts = backend, prompts
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        # tensors live where the backend computes; one host copy per step brings the tokens back
        self.device = torch.device(getattr(backend, "device", "cpu"))
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.eos = set(eos_token_ids)
        self.result = GenerationResult([[] for _ in prompts],
                                       SpecStats(k=backend.k if self.speculative else 0))

    def _emit(self, b: int, tokens: list[int], record: dict) -> Emission:
        """Append ``tokens`` to sequence ``b`` up to its first EOS or its budget."""
        out = self.result.token_ids[b]
        before = len(out)
        for token in tokens[: self.max_new_tokens - before]:
            out.append(token)
            if token in self.eos:
                break
        finished = len(out) >= self.max_new_tokens or out[-1] in self.eos
        self.result.trace.append({"sequence": b, **record, "emitted": out[before:]})
        return Emission(b, out[before:], finished)

    def __iter__(self) -> Iterator[list[Emission]]:
        steps = self._steps()
        while True:
            with _torch_threads(getattr(self.backend, "host_threads", None)):
                emissions = next(steps, None)
            if emissions is None:
                return
            yield emissions

    def _steps(self) -> Iterator[list[Emission]]:
        backend, times = self.backend, self.result.times
        batch, device = len(self.prompts), self.device
        lengths = torch.tensor([len(p) for p in self.prompts], device=device)
        resumed = time.perf_counter()   # total time excludes what the consumer does between steps

        def timed(phase: str, call, *args):
            begin = time.perf_counter()
            out = call(*args)
            setattr(times, phase, getattr(times, phase) + time.perf_counter() - begin)
            return out

        backend.start(batch)
        last_logits, (ctx_aux, ctx_start, ctx_count) = timed(
            "prefill", _prefill, backend, self.prompts, lengths, self.speculative)
        anchor = next_token(last_logits, self.temperature, self.top_p, self.generator)
        emissions = [self._emit(b, [token], {"step": 0, "anchor": None, "drafts": [], "accepted": 0})
                     for b, token in enumerate(anchor.tolist())]
        done = [e.finished for e in emissions]
        times.total += time.perf_counter() - resumed
        yield emissions

        greedy = self.temperature == 0
        temperatures = torch.full((batch,), 1.0 if greedy else self.temperature, device=device)
        noise_shape = (batch, backend.k, backend.draft_vocab_size)
        zero_noise = torch.zeros(noise_shape, device=device) if self.speculative and greedy else None
        no_drafts = torch.zeros(batch, 0, dtype=torch.long, device=device)
        no_accepted = torch.zeros(batch, dtype=torch.long, device=device)
        first_row = torch.zeros(batch, 1, dtype=torch.long, device=device)   # logit rows of 1 anchor
        every_draft = torch.full((batch,), backend.k, device=device)
        anchor_pos = lengths.clone()                 # = each target cache's valid length
        positions = lengths.tolist()
        live = [b for b in range(batch) if not done[b]]
        step = 0
        while live:
            resumed = time.perf_counter()
            step += 1
            if self.speculative:
                noise = zero_noise if greedy else gumbel_noise(noise_shape, self.generator)
                drafts, q = timed("draft", backend.draft_step, ctx_aux, ctx_start, ctx_count, anchor,
                                  temperatures, noise)
                limit = every_draft                  # drafts proposed, per sequence
                if self.confidence_threshold > 0:
                    drafts, q, limit = self._confident(drafts, q, live)
                block = torch.cat([anchor[:, None], drafts], 1)
                every_row = torch.arange(block.shape[1], device=device).expand(block.shape)
                logits, aux = timed("verify", backend.target_step, block, anchor_pos, every_row)
                if greedy:
                    accepted, emitted = greedy_verify(drafts, logits, limit)
                else:
                    p = probabilities(logits, self.temperature, self.top_p)
                    accepted, emitted = rejection_verify(drafts, q, p, self.generator, limit)
            else:
                drafts, accepted, limit = no_drafts, no_accepted, no_accepted
                logits, aux = timed("verify", backend.target_step, anchor[:, None], anchor_pos,
                                    first_row)
                emitted = next_token(logits, self.temperature, self.top_p, self.generator)

            # the step's only device -> host copy: accepted and proposed counts, emitted tokens,
            # drafts, anchor
            width = emitted.shape[1]
            host = torch.cat([accepted[:, None], limit[:, None], emitted, drafts, anchor[:, None]],
                             1).tolist()
            emissions, counts, anchors = [], [0] * batch, [row[-1] for row in host]
            for b in live:
                a, proposed, row = host[b][0], host[b][1], host[b][2:]   # row: emitted, drafts, anchor
                self.result.stats.record(a)
                emission = self._emit(b, row[:a + 1], {
                    "step": step, "anchor": row[-1], "drafts": row[width:width + proposed],
                    "accepted": a})
                emissions.append(emission)
                if emission.finished:
                    # it stays in the batch frozen (same anchor and start, no new context), so it
                    # never writes past the rows its prompt and budget were given
                    continue
                counts[b] = a + 1
                anchors[b] = row[a]
                positions[b] += a + 1
            ctx_aux, ctx_start = aux, anchor_pos
            ctx_count, anchor, anchor_pos = torch.tensor([counts, anchors, positions], device=device).unbind()
            live = [e.sequence for e in emissions if not e.finished]
            times.total += time.perf_counter() - resumed
            yield emissions

    def _confident(self, drafts: torch.Tensor, q: torch.Tensor, live: list[int]):
        """Each sequence's drafts before the first whose distribution's top probability is below
        ``confidence_threshold`` (``limit [B]`` of them); the batch verifies the widest live one.
        The rule reads the draft's distributions, never the token drawn from them, so sampling
        stays exact, and greedy output is the target's whatever is cut."""
        limit = (q.amax(-1) >= self.confidence_threshold).cumprod(dim=1).sum(dim=1)
        width = int(limit[live].max())
        return drafts[:, :width], q[:, :width], limit


@contextmanager
def _torch_threads(count: int | None):
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


def _check_capacity(backend, prompts: list[list[int]], max_new_tokens: int, speculative: bool,
                    names: list[str]) -> None:
    """Refuse the first prompt that is empty or whose tokens, ``max_new_tokens`` and the rows a
    step may write past them do not fit the KV cache, naming it; every prompt is checked before
    any runs."""
    rows = max_new_tokens + (backend.lookahead if speculative else 1)
    for name, prompt in zip(names, prompts):
        if not prompt:
            raise ValueError(f"{name}: no tokens; expected at least one")
        if len(prompt) + rows > backend.capacity:
            raise ValueError(f"{name} has {len(prompt)} tokens: with max_new_tokens {max_new_tokens} "
                             f"it needs {len(prompt) + rows} KV-cache rows; the capacity is "
                             f"{backend.capacity} (build --max-seq-len)")


def generate(backend, prompts: list[list[int]], **options) -> GenerationResult:
    """Run a ``Decoding`` to the end (options as there) and return its result."""
    decoding = Decoding(backend, prompts, **options)
    for _ in decoding:
        pass
    return decoding.result


def _prefill(backend, prompts, lengths, speculative: bool):
    """Run the prompts through the target in chunks of at most ``backend.max_prompt_chunk`` rows
    (right-padded: rows past a prompt's end are scratch). Every chunk but the last is inserted into
    the draft's context right away (its proposals are discarded); the last one is returned as the
    first draft step's context. Returns each prompt's last-position logits and that context.

    Each chunk asks the target for one row of logits per prompt: its last row where the prompt
    ends in the chunk, a row that is not read otherwise (clamped into the chunk)."""
    batch, longest, device = len(prompts), max(map(len, prompts)), lengths.device
    padded = torch.zeros(batch, longest, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        padded[b, : len(prompt)] = torch.tensor(prompt)
    padded = padded.to(device)
    chunk = backend.max_prompt_chunk
    last_logits = None
    for begin in range(0, longest, chunk):
        ids = padded[:, begin:begin + chunk]
        last_row = lengths - 1 - begin
        here = (last_row >= 0) & (last_row < ids.shape[1])
        logits, aux = backend.target_step(ids, torch.full((batch,), begin, device=device),
                                          last_row.clamp(0, ids.shape[1] - 1)[:, None])
        # a copy: an engine backend reuses its output buffer for the next chunk of this shape
        picked = logits[:, 0].clone()
        last_logits = picked if last_logits is None else torch.where(here[:, None], picked, last_logits)
        context = (aux, lengths.clamp(max=begin), (lengths - begin).clamp(0, ids.shape[1]))
        if speculative and begin + chunk < longest:
            next_tokens = padded[:, begin + chunk]
            backend.draft_step(*context, next_tokens, torch.ones(batch, device=device),
                               torch.zeros(batch, backend.k, backend.draft_vocab_size, device=device))
    return last_logits, context
