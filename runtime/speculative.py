"""The propose / verify loop (design.md §5), for a batch of ragged prompts on any backend.

Per step and sequence: the draft proposes ``k`` tokens after the anchor; the target runs
``[anchor, d_1 .. d_k]`` at positions ``p_anchor ..``; the verifier accepts ``a`` drafts and emits
a correction / bonus token, which is the next anchor at ``p_anchor + a + 1``. Only the verified
rows (old anchor + accepted drafts) become draft context, and both caches' valid lengths move to
``p_anchor + a + 1``: rejected rows stay in the caches as scratch that the next step overwrites.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import gumbel_noise, next_token, probabilities
from .stats import SpecStats
from .verify import greedy_verify, rejection_verify


@dataclass
class GenerationResult:
    token_ids: list[list[int]]                    # generated ids per prompt (prompt excluded)
    stats: SpecStats
    trace: list[dict] = field(default_factory=list)   # one record per step and sequence


def generate(backend, prompts: list[list[int]], *, max_new_tokens: int = 128,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             eos_token_ids=(), speculative: bool = True) -> GenerationResult:
    """Generate up to ``max_new_tokens`` after each prompt; a sequence stops at its first EOS
    (kept in the output). ``temperature == 0`` is greedy: the output is exactly the target's
    own greedy output. Otherwise it is distributed as the target's sampling distribution."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens {max_new_tokens}: expected at least 1")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature {temperature} / top_p {top_p}: expected temperature >= 0 "
                         f"and 0 < top_p <= 1")
    speculative = speculative and backend.k > 0
    lengths = torch.tensor([len(p) for p in prompts])
    needed = int(lengths.max()) + max_new_tokens + (backend.lookahead if speculative else 1)
    if needed > backend.capacity:
        raise ValueError(f"the longest prompt ({int(lengths.max())} tokens) + max_new_tokens "
                         f"({max_new_tokens}) needs {needed} KV-cache rows; the capacity is "
                         f"{backend.capacity}")

    batch, rows = len(prompts), torch.arange(len(prompts))
    generator = torch.Generator().manual_seed(seed)
    eos = set(eos_token_ids)
    out: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(batch, dtype=torch.bool)
    stats = SpecStats(k=backend.k if speculative else 0)
    trace: list[dict] = []

    def emit(b: int, tokens: list[int], record: dict) -> None:
        """Append ``tokens`` to sequence ``b`` up to its first EOS or its budget."""
        before = len(out[b])
        for token in tokens[: max_new_tokens - before]:
            out[b].append(token)
            if token in eos:
                break
        done[b] = len(out[b]) >= max_new_tokens or out[b][-1] in eos
        trace.append({"sequence": b, **record, "emitted": out[b][before:]})

    backend.start(batch)
    last_logits, (ctx_aux, ctx_start, ctx_count) = _prefill(backend, prompts, lengths, speculative)
    anchor = next_token(last_logits, temperature, top_p, generator)
    for b in range(batch):
        emit(b, [int(anchor[b])], {"step": 0, "anchor": None, "drafts": [], "accepted": 0})

    anchor_pos = lengths.clone()                 # = each target cache's valid length
    greedy_temperature = torch.ones(batch)
    step = 0
    while not bool(done.all()):
        step += 1
        if speculative:
            k, vd = backend.k, backend.draft_vocab_size
            if temperature == 0:
                drafts, q = backend.draft_step(ctx_aux, ctx_start, ctx_count, anchor,
                                               greedy_temperature, torch.zeros(batch, k, vd))
            else:
                drafts, q = backend.draft_step(ctx_aux, ctx_start, ctx_count, anchor,
                                               torch.full((batch,), temperature),
                                               gumbel_noise((batch, k, vd), generator))
            logits, aux = backend.target_step(torch.cat([anchor[:, None], drafts], 1), anchor_pos)
            if temperature == 0:
                accepted, emitted = greedy_verify(drafts, logits)
            else:
                accepted, emitted = rejection_verify(drafts, q, probabilities(logits, temperature, top_p),
                                                     generator)
        else:
            drafts = torch.zeros(batch, 0, dtype=torch.long)
            logits, aux = backend.target_step(anchor[:, None], anchor_pos)
            accepted = torch.zeros(batch, dtype=torch.long)
            emitted = next_token(logits, temperature, top_p, generator)

        live = ~done
        for b in live.nonzero()[:, 0].tolist():
            a = int(accepted[b])
            stats.record(a)
            emit(b, emitted[b, : a + 1].tolist(),
                 {"step": step, "anchor": int(anchor[b]), "drafts": drafts[b].tolist(), "accepted": a})
        ctx_aux, ctx_start = aux, anchor_pos
        ctx_count = torch.where(live, accepted + 1, 0)
        anchor = torch.where(live, emitted[rows, accepted], anchor)
        anchor_pos = anchor_pos + ctx_count
    return GenerationResult(out, stats, trace)


def _prefill(backend, prompts, lengths, speculative: bool):
    """Run the prompts through the target in chunks of at most ``backend.max_prompt_chunk`` rows
    (right-padded: rows past a prompt's end are scratch). Every chunk but the last is inserted into
    the draft's context right away (its proposals are discarded); the last one is returned as the
    first draft step's context. Returns each prompt's last-position logits and that context."""
    batch, longest = len(prompts), int(lengths.max())
    padded = torch.zeros(batch, longest, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        padded[b, : len(prompt)] = torch.tensor(prompt)
    chunk = backend.max_prompt_chunk
    last_logits = None
    for begin in range(0, longest, chunk):
        ids = padded[:, begin:begin + chunk]
        logits, aux = backend.target_step(ids, torch.full((batch,), begin))
        if last_logits is None:
            last_logits = logits.new_zeros(batch, logits.shape[-1])
        last_row = lengths - 1 - begin
        here = (last_row >= 0) & (last_row < ids.shape[1])
        last_logits[here] = logits[here, last_row[here]]
        context = (aux, lengths.clamp(max=begin), (lengths - begin).clamp(0, ids.shape[1]))
        if speculative and begin + chunk < longest:
            next_tokens = padded[:, begin + chunk]
            backend.draft_step(*context, next_tokens, torch.ones(batch),
                               torch.zeros(batch, backend.k, backend.draft_vocab_size))
    return last_logits, context
