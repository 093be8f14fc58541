"""The backend contract: what the loop (``runtime/decoding/executor.py``) needs of whatever runs the
two steps.

A backend (ONNX Runtime, PyTorch, TensorRT) owns the caches and runs the target and draft steps;
``BackendLimits`` holds the facts the loop plans with, read from an engine's manifest or from the modules,
so that no backend declares them by hand and no caller re-derives the KV capacity a run needs.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class BackendLimits:
    """An engine's shape facts and limits (a draft-less backend has ``k == 0``)."""
    vocab_size: int
    k: int                       # drafts per step
    block_size: int              # the draft's block (0 without a draft)
    capacity: int                # KV-cache rows per sequence (build --max-seq-len)
    max_batch: int
    max_prompt_chunk: int        # most prompt rows per prefill call
    eos_token_ids: tuple[int, ...]
    confidence_threshold: float  # the default draft cut (0: verify all k)
    state_slots: int = 0         # a hybrid target's recurrent-state slots per layer (k + 1), else 0
    rings: bool = False          # sliding layers keep their last rows only (Gemma 4)

    @classmethod
    def from_manifest(cls, m: dict) -> "BackendLimits":
        from common.manifest import confidence_threshold, is_cache

        draft, limits = m["draft"], m["limits"]
        # what the target graph takes says the rest, whatever its family: state caches with a slot
        # axis (a hybrid's, k + 1 slots), K / V caches shorter than the capacity (rings)
        inputs = m["graphs"]["target"]["inputs"]
        slots = next((t["shape"][1] for t in inputs if t["name"].startswith("state_cache_")), 0)
        rings = any(is_cache(t["name"]) and t["shape"][2] < limits["max_seq_len"] for t in inputs
                    if not t["name"].startswith("state_cache_"))
        return cls(vocab_size=m["target"]["vocab_size"], k=draft["k"], block_size=draft["block_size"],
                   capacity=limits["max_seq_len"],
                   max_batch=limits["max_batch"], max_prompt_chunk=limits["max_prompt_chunk"],
                   eos_token_ids=tuple(m["target"]["eos_token_ids"]),
                   confidence_threshold=confidence_threshold(m), state_slots=slots, rings=rings)

    @classmethod
    def from_modules(cls, target, draft, capacity: int, max_batch: int = 1 << 16,
                     max_prompt_chunk: int | None = None,
                     confidence_threshold: float = 0.0) -> "BackendLimits":
        """For the PyTorch reference modules (``draft`` None: target-only)."""
        return cls(vocab_size=target.config.vocab_size, k=draft.k if draft is not None else 0,
                   block_size=draft.config.block_size if draft is not None else 0,
                   capacity=capacity, max_batch=max_batch, max_prompt_chunk=max_prompt_chunk or capacity,
                   eos_token_ids=tuple(target.config.eos_token_ids),
                   confidence_threshold=confidence_threshold,
                   state_slots=(draft.k if draft is not None else 0) + 1 if target.takes_states else 0,
                   rings=target.rings)

    @property
    def call_rows(self) -> int:
        """The most rows one target call writes (``common.manifest.call_rows``)."""
        from common.manifest import call_rows

        return call_rows(self.max_prompt_chunk, self.k)

    @property
    def lookahead(self) -> int:
        """Cache rows a step may write past a sequence's valid length: the verify block (``k + 1``
        rows) or the draft's scratch block, whichever is longer (1 without a draft)."""
        return max(self.k + 1, self.block_size)

    def target_feeds(self, input_ids: torch.Tensor, start: torch.Tensor, logit_rows: torch.Tensor,
                     state_slot: torch.Tensor | None, state_rows: torch.Tensor | None) -> tuple[dict, dict]:
        """A target call's inputs by graph name, in the graph's order, and the sizes of its dynamic
        axes; a hybrid target's recurrent-state inputs only where it has them, at most its
        ``state_slots`` states kept per call."""
        feeds = {"input_ids": input_ids, "start": start, "logit_rows": logit_rows}
        sizes = {"batch": input_ids.shape[0], "rows": input_ids.shape[1], "logit_rows": logit_rows.shape[1]}
        if self.state_slots:
            if state_rows.shape[1] > self.state_slots:
                raise ValueError(f"state_rows: {state_rows.shape[1]} states to keep, the engine has "
                                 f"{self.state_slots} slots (k + 1)")
            feeds |= {"state_slot": state_slot, "state_rows": state_rows}
            sizes["state_rows"] = state_rows.shape[1]
        return feeds, sizes

    def check_batch(self, batch: int) -> None:
        if batch > self.max_batch:
            raise ValueError(f"batch of {batch} sequences: the engine was built for at most "
                             f"{self.max_batch} (--max-batch)")


def capacity_needed(prompt_tokens: int, max_new_tokens: int, limits: BackendLimits | None = None, *,
                    k: int = 0, block_size: int = 0) -> int:
    """KV-cache rows a run of ``max_new_tokens`` after a ``prompt_tokens``-token prompt needs:
    the prompt, the new tokens and the rows one step may write past them (``BackendLimits.lookahead``, of
    ``limits`` or of ``k`` / ``block_size``)."""
    lookahead = limits.lookahead if limits is not None else max(k + 1, block_size)
    return prompt_tokens + max_new_tokens + lookahead


def slot_block(slots: list[int] | None, pool: int, backend: str) -> slice:
    """The slots a step of a ``pooled`` backend runs on, as the block of its caches they are: its
    CUDA graphs hold the whole pool's caches, so a step on fewer slots (a prefill, which runs
    eagerly anyway) takes consecutive ones (``slots`` None: the whole pool)."""
    if slots is None:
        return slice(0, pool)
    first = slots[0] if slots else 0
    if list(slots) != list(range(first, first + len(slots))) or first + len(slots) > pool:
        raise ValueError(f"slots {list(slots)}: {backend} runs a step on consecutive slots of its pool "
                         f"of {pool} (its CUDA graphs hold their caches as one block)")
    return slice(first, first + len(slots))


@dataclass(frozen=True)
class Hints:
    """How a loop best drives a backend, which it may ignore at a cost in speed only:
    ``host_threads``, how many threads the loop's own torch work between calls may use (None:
    leave torch's setting); ``default_batch``, how many prompts a ``Generator`` batches unless
    told (None: ``max_batch``)."""
    host_threads: int | None = None
    default_batch: int | None = None


class Backend(Protocol):
    """What the executor drives. Tensors live on ``device``. ``pooled`` is a contract: every
    decode step runs the whole pool of slots in order (CUDA graphs captured on its caches), and a
    prefill a block of consecutive slots (``slot_block``); ``hints`` are not."""
    limits: BackendLimits
    device: torch.device
    pooled: bool
    hints: Hints

    def start(self, batch: int) -> None:
        """Empty caches for a pool of ``batch`` slots, one sequence each."""

    def clear(self, slot: int) -> None:
        """A new sequence starts in ``slot``, the others go on: none of what the slot held may
        reach it (empty caches, or rows its steps never read)."""

    def target_step(self, input_ids: torch.Tensor, start: torch.Tensor, logit_rows: torch.Tensor,
                    state_slot: torch.Tensor | None = None,
                    state_rows: torch.Tensor | None = None,
                    slots: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids [B, L]`` at positions ``start [B] ..`` -> ``(logits [B, R, V]`` at the
        ``logit_rows [B, R]``, ``aux [B, L, T * H]`` the draft's context rows). Batch row ``b``
        reads and writes the caches of slot ``slots[b]`` (None: slot ``b`` of every slot).
        A hybrid target (``limits.state_slots > 0``) starts each sequence's recurrent state from
        its state slot ``state_slot [B]`` and keeps in state slot ``j`` the state after row
        ``state_rows [B, J]`` (``-1``: before the call), and needs both; other targets ignore
        them."""

    def draft_step(self, ctx_aux: torch.Tensor, ctx_start: torch.Tensor, ctx_count: torch.Tensor,
                   anchor: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor,
                   slots: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """New context rows and the anchors -> ``(drafts [B, k]`` (target ids), ``q [B, k, V_target]``
        the distributions they were drawn from); ``slots`` as for ``target_step``."""


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
