"""Prefill: a batch of prompts through the target in chunks, the draft's context inserted as they
go (``docs/engine-contract.md#prefill``)."""
from __future__ import annotations

from typing import Callable

import torch

from runtime.backends.base import Backend


def prefill_chunks(backend: Backend, prompts, lengths, speculative: bool,
                   every_row: Callable[[int, torch.Tensor], None] | None = None,
                   slots: list[int] | None = None, offsets=None, state_slot=None):
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
    (row -1) for a prompt that ended in an earlier one: padding never advances it. With
    ``every_row``, each chunk asks for the logits of all its rows instead and hands them to
    ``every_row(begin, logits [B, L, V])`` (for prompt log-probabilities).

    ``offsets [B]``: rows the caches already hold (a reused slot's, ``runtime/decoding/prefix_cache.py``);
    ``prompts`` are then what follows them, at positions ``offsets + i``, and a hybrid target
    starts from the state in state slot ``state_slot [B]`` (default: 0, as a cleared slot)."""
    batch, longest, device = len(prompts), max(map(len, prompts)), lengths.device
    padded = torch.zeros(batch, longest, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        padded[b, : len(prompt)] = torch.tensor(prompt)
    padded = padded.to(device)
    chunk = backend.limits.max_prompt_chunk
    last_logits = None
    offsets = torch.zeros_like(lengths) if offsets is None else offsets
    slot = torch.zeros_like(lengths) if state_slot is None else state_slot
    for begin in range(0, longest, chunk):
        ids = padded[:, begin:begin + chunk]
        last_row = lengths - 1 - begin
        here = (last_row >= 0) & (last_row < ids.shape[1])
        row = last_row.clamp(0, ids.shape[1] - 1)[:, None]
        rows = torch.arange(ids.shape[1], device=device).expand(batch, -1) if every_row else row
        logits, aux = backend.target_step(ids, offsets + lengths.clamp(max=begin), rows, slot,
                                          last_row.clamp(-1, ids.shape[1] - 1)[:, None], slots=slots)
        slot = torch.zeros_like(lengths)        # from the first chunk on, the state is in slot 0
        if every_row:
            every_row(begin, logits)
            logits = logits.gather(1, row[..., None].expand(-1, -1, logits.shape[-1]))
        # a copy: an engine backend reuses its output buffer for the next chunk of this shape
        picked = logits[:, 0].clone()
        last_logits = picked if last_logits is None else torch.where(here[:, None], picked, last_logits)
        context = (aux, offsets + lengths.clamp(max=begin), (lengths - begin).clamp(0, ids.shape[1]))
        if speculative and begin + chunk < longest:
            insert_context(backend, *context, padded[:, begin + chunk], slots)
        if begin + chunk < longest:
            yield None
    yield last_logits, context


def insert_context(backend: Backend, aux, start, count, next_tokens, slots: list[int] | None = None) -> None:
    """Insert context rows ``aux [B, R, T * H]`` (``count [B]`` of them from position ``start [B]``)
    into the draft's caches, the token after them ``next_tokens [B]``; its proposals are discarded."""
    batch, limits = next_tokens.shape[0], backend.limits
    backend.draft_step(aux, start, count, next_tokens, torch.ones(batch, device=next_tokens.device),
                       torch.zeros(batch, limits.k, limits.vocab_size, device=next_tokens.device),
                       slots=slots)
