"""The PyTorch reference backend: runs ``TargetStep`` / ``DraftStep`` eagerly and owns their caches.

Every backend offers the same things (``backend.Backend``: ``start``, ``target_step``,
``draft_step`` and its ``BackendLimits``), so the loop in ``speculative.py`` never knows which one it drives.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from export import manifest as manifest_file
from export.draft_model import DraftStep
from export.pair import load_pair
from export.target_model import TargetStep

from .backend import BackendLimits, check_whole_pool


class TorchBackend:
    """``device="cuda"`` with ``cuda_graphs=True`` captures the decode steps and replays them, the
    same way the TensorRT backend does (``cuda_graphs.py``); prefill runs eagerly."""

    def __init__(self, target: TargetStep, draft: DraftStep | None, capacity: int,
                 max_batch: int = 1 << 16, max_prompt_chunk: int | None = None,
                 confidence_threshold: float = 0.0, device: str = "cpu", cuda_graphs: bool = False):
        self.device = torch.device(device)
        target, draft = target.to(self.device), draft.to(self.device) if draft is not None else None
        self.target, self.draft = target, draft
        self.limits = BackendLimits.from_modules(target, draft, capacity, max_batch, max_prompt_chunk,
                                          confidence_threshold)
        self.host_threads = self.default_batch = None
        self.graphs = self.caches = None
        if cuda_graphs:
            from .cuda_graphs import Caches, GraphCache

            # prefill too writes the caches in place: the graphs hold their addresses
            self.graphs = GraphCache(self.limits.k,
                                     eager=lambda step, _, inputs: self._step_in_place(step, *inputs),
                                     bind=lambda step, _, inputs: partial(self._step_in_place, step, *inputs))
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
                                  k=m["draft"]["k"], dtype=dtype)
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
        # a hybrid's recurrent-state slots; a Gemma 4 target's sliding rings hold the rows a call writes
        extra = ((self.limits.state_slots,) if self.limits.state_slots else
                 (self.limits.call_rows,) if self.target.config.gemma4 is not None else ())
        caches = {"target": self.target.empty_cache(batch, self.limits.capacity, *extra)}
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
        inputs = [input_ids, start, logit_rows]
        if self.limits.state_slots:   # a hybrid target's recurrent-state slots
            self.limits.check_states(state_rows)
            inputs += [state_slot, state_rows]
        if self.graphs is not None:
            check_whole_pool(slots, self.caches.batch, "torch-cuda")
            batch, rows = input_ids.shape
            return self.graphs("target", {"batch": batch, "rows": rows, "logit_rows": logit_rows.shape[1]},
                               inputs)
        logits, aux = self._eager(self.target, self.target_cache, inputs, slots)
        return logits, aux

    @torch.no_grad()
    def draft_step(self, ctx_aux, ctx_start, ctx_count, anchor, temperature, noise, slots=None):
        inputs = [ctx_aux, ctx_start, ctx_count, anchor, temperature, noise]
        if self.graphs is not None:
            check_whole_pool(slots, self.caches.batch, "torch-cuda")
            batch, rows = ctx_aux.shape[:2]
            return self.graphs("draft", {"batch": batch, "ctx_rows": rows}, inputs)
        tokens, q = self._eager(self.draft, self.draft_cache, inputs, slots)
        return tokens, q

    @staticmethod
    def _eager(module, caches: list[torch.Tensor], inputs: list, slots: list[int] | None):
        """``module`` on ``inputs``, batch row ``b`` on the caches of slot ``slots[b]`` (default:
        every slot in order): those slots' caches are gathered, and the new ones written back."""
        if slots is None:
            first, second, *caches[:] = module(*inputs, *caches)
            return first, second
        index = torch.tensor(slots, device=caches[0].device)
        first, second, *new = module(*inputs, *[cache[index] for cache in caches])
        for cache, value in zip(caches, new):
            cache[index] = value
        return first, second

    def _step_in_place(self, which: str, *inputs):
        """One step that writes its new caches back into the current ones (graph capture needs
        fixed addresses)."""
        module = self.target if which == "target" else self.draft
        caches = self.caches[which]
        first, second, *new = module(*inputs, *caches)
        for cache, value in zip(caches, new):
            cache.copy_(value)
        return [first, second]
