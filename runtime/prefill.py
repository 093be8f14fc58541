"""Prefill: a batch of prompts through the target in chunks, the draft's context inserted as they
go (``docs/engine-contract.md#prefill``)."""
from __future__ import annotations

import torch

from .backend import Backend


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
