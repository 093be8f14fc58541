"""The PyTorch reference backend: runs ``TargetStep`` / ``DraftStep`` eagerly and owns their caches.

Every backend offers the same things (``backend.Backend``: ``start``, ``target_step``,
``draft_step`` and its ``BackendLimits``), so the loop (``scheduler.py``) never knows which one it drives.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from common import manifest as manifest_file
from modeling.dense import TargetStep
from modeling.draft import DraftStep
from modeling.pair import load_pair
from runtime.backends.base import BackendLimits, Hints, slot_block


class TorchBackend:
    """``device="cuda"`` with ``cuda_graphs=True`` captures the decode steps and replays them, the
    same way the TensorRT backend does (``cuda_graphs.py``); prefill runs eagerly."""
    pooled = True    # batched steps: a decode step runs the whole pool, a frozen row costs no call


    def __init__(self, target: TargetStep, draft: DraftStep | None, capacity: int,
                 max_batch: int = 1 << 16, max_prompt_chunk: int | None = None,
                 confidence_threshold: float = 0.0, device: str = "cpu", cuda_graphs: bool = False):
        self.device = torch.device(device)
        target, draft = target.to(self.device), draft.to(self.device) if draft is not None else None
        self.target, self.draft = target, draft
        self.limits = BackendLimits.from_modules(target, draft, capacity, max_batch, max_prompt_chunk,
                                          confidence_threshold)
        self.hints = Hints()
        self.graphs = self.caches = None
        if cuda_graphs:
            from runtime.backends.cuda_graphs import Caches, GraphCache

            # prefill too writes the caches in place: the graphs hold their addresses
            self.graphs = GraphCache(self.limits.k, eager=lambda step, _, inputs: self._eager(step, inputs),
                                     bind=lambda step, _, inputs: partial(self._eager, step, inputs))
            self.caches = Caches(self._empty_caches)

    @classmethod
    def from_engine(cls, engine: str | Path, device: str = "cpu",
                    cuda_graphs: bool = False) -> "TorchBackend":
        """The reference modules for an engine directory, with its limits. Unlike the engine
        backends this reads the source checkpoints that ``manifest.json`` records."""
        m = manifest_file.read(Path(engine))
        sources = m["source"]
        for side in ("target", "draft"):
            if not Path(sources[side]["path"]).exists():
                raise manifest_file.ManifestError(
                    f"{engine}: the torch backend runs the reference modules from the source "
                    f"checkpoints, and the {side} recorded in manifest.json "
                    f"({sources[side]['path']}) is not there; use --backend ort")
        dtype = getattr(torch, m["dtype"])
        target, draft = load_pair(sources["target"]["path"], sources["draft"]["path"],
                                  k=m["draft"]["k"], dtype=dtype,
                                  markov_top_k=m["draft"].get("markov_top_k", 0))
        limits = m["limits"]
        return cls(target, draft, limits["max_seq_len"], limits["max_batch"], limits["max_prompt_chunk"],
                   manifest_file.confidence_threshold(m), device=device, cuda_graphs=cuda_graphs)

    def start(self, batch: int) -> None:
        """Empty caches for ``batch`` sequences: with CUDA graphs, the ones the graphs captured,
        zeroed in place (``cuda_graphs.Caches``)."""
        self.limits.check_batch(batch)
        if self.caches is None:
            fresh = self._empty_caches(batch)
            self.target_cache, self.draft_cache = fresh["target"], fresh.get("draft", [])
        elif self.caches.start(batch):
            self.graphs.clear()

    def _empty_caches(self, batch: int) -> dict[str, list[torch.Tensor]]:
        # a hybrid's recurrent-state slots; sliding rings hold the rows a call writes
        limits = self.limits
        caches = {"target": self.target.empty_cache(batch, limits.capacity, max(1, limits.state_slots),
                                                    limits.call_rows)}
        if self.draft is not None:
            caches["draft"] = self.draft.empty_cache(batch, self.limits.capacity)
        return caches

    def clear(self, slot: int) -> None:
        """Zero ``slot``'s caches (a new sequence there; the others keep theirs)."""
        if self.caches is None:
            caches = [*self.target_cache, *self.draft_cache]
        else:
            caches = [*self.caches["target"], *(self.caches["draft"] if self.draft is not None else [])]
        for cache in caches:
            cache[slot].zero_()

    @torch.no_grad()
    def target_step(self, input_ids: torch.Tensor, start: torch.Tensor, logit_rows: torch.Tensor,
                    state_slot: torch.Tensor | None = None, state_rows: torch.Tensor | None = None,
                    slots: list[int] | None = None):
        feeds, sizes = self.limits.target_feeds(input_ids, start, logit_rows, state_slot, state_rows)
        return self._run("target", list(feeds.values()), sizes, slots)

    @torch.no_grad()
    def draft_step(self, ctx_aux, ctx_start, ctx_count, anchor, temperature, noise, slots=None):
        batch, rows = ctx_aux.shape[:2]
        return self._run("draft", [ctx_aux, ctx_start, ctx_count, anchor, temperature, noise],
                         {"batch": batch, "ctx_rows": rows}, slots)

    def _pool_caches(self, which: str) -> list[torch.Tensor]:
        if self.caches is not None:
            return self.caches[which]
        return self.target_cache if which == "target" else self.draft_cache

    def _run(self, which: str, inputs: list, sizes: dict[str, int], slots: list[int] | None):
        """A step of the whole pool (through the CUDA graphs, where there are any), or of a block
        of its slots eagerly."""
        pool = self._pool_caches("target")[0].shape[0]
        block = slot_block(slots, pool, "the torch backend")
        if self.graphs is not None and block == slice(0, pool):
            return self.graphs(which, sizes, inputs)
        return self._eager(which, inputs, block)

    def _eager(self, which: str, inputs: list, block: slice = slice(None)):
        """``which`` on the ``block`` of slots. The step's new caches replace the current ones; with
        CUDA graphs, which hold the caches' addresses, or on part of the pool they are copied in."""
        module = self.target if which == "target" else self.draft
        caches = self._pool_caches(which)
        first, second, *new = module(*inputs, *[cache[block] for cache in caches])
        if self.graphs is None and block == slice(0, caches[0].shape[0]):
            caches[:] = new
        else:
            for cache, value in zip(caches, new):
                cache[block].copy_(value)
        return [first, second]
