"""CUDA-graph capture and replay of the decode steps, shared by the TensorRT backend and the
PyTorch backend on CUDA.

Only the shapes that repeat every step are captured (``capture_key``): a verify or draft step's
``batch x rows`` with rows up to ``k + 1``, at most ``max_batch x (k + 1)`` graphs per step. A
prefill chunk's rows follow the prompt length, so capturing it would run the chunk three times
(two warm-ups and the capture) and keep a set of output buffers for nearly every prompt; it runs
eagerly. The graphs outlive requests: the caches they hold the addresses of stay where they are
(``Caches``) and are zeroed in place.

Per captured key the step's inputs are copied into static buffers, the graph replays and its
static outputs are returned. State the step updates in place (the KV caches) is captured by
address. Our steps are idempotent for equal inputs (they write the same cache rows), so the
warm-up runs before capture change nothing.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch

Sizes = dict[str, int]   # a step's dynamic axes: batch, rows (or ctx_rows), logit_rows, state_rows


def capture_key(step: str, sizes: Sizes, k: int) -> tuple[str, int, int] | None:
    """``(step, batch, rows)`` when the step is captured, ``None`` when it runs eagerly: captured
    are rows up to ``k + 1`` (a verify block, a draft's context from one) where the target asks for
    logits for every row, as verifying does; a short prompt's prefill chunk asks for one."""
    rows = sizes["rows"] if "rows" in sizes else sizes["ctx_rows"]
    if rows > k + 1 or sizes.get("logit_rows", rows) != rows:
        return None
    return step, sizes["batch"], rows


class GraphCache:
    """A backend's captured graphs by ``capture_key``, beside its eager path.

    ``eager(step, sizes, inputs)`` runs a step on any inputs. ``bind(step, sizes, static_inputs)``
    prepares a key before its warm-up (a TensorRT context's shapes and addresses) and returns the
    step on those buffers, ``run() -> outputs``, or ``None`` when the key cannot be captured: it
    then runs eagerly, said once on stderr. ``stream``: the capture stream (a backend's own, that
    ``bind`` checked); by default one of the cache's.

    All graphs share one memory pool: safe because each graph's inputs and outputs stay allocated
    as long as it does, and graphs replay one at a time."""

    def __init__(self, k: int, eager: Callable, bind: Callable[..., Callable[[], list] | None],
                 stream: torch.cuda.Stream | None = None, warmup: int = 2):
        self.k, self.eager, self.bind, self.stream, self.warmup = k, eager, bind, stream, warmup
        self.graphs: dict[tuple, tuple | None] = {}   # None: the key runs eagerly
        self.pool = None

    def __call__(self, step: str, sizes: Sizes, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        key = capture_key(step, sizes, self.k)
        if key is not None and key not in self.graphs:
            self.graphs[key] = self._capture(step, sizes, inputs)
        captured = self.graphs.get(key)
        if captured is None:
            return self.eager(step, sizes, inputs)
        graph, static_inputs, static_outputs = captured
        for buffer, value in zip(static_inputs, inputs):
            buffer.copy_(value, non_blocking=True)
        graph.replay()
        return static_outputs

    def _capture(self, step: str, sizes: Sizes, inputs: list[torch.Tensor]):
        static_inputs = [value.clone() for value in inputs]
        run = self.bind(step, sizes, static_inputs)
        if run is None:
            print(f"{step} step, sizes {sizes}: cannot be captured as a CUDA graph; it runs eagerly",
                  file=sys.stderr)
            return None
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = self.stream or torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):   # warm-up off the default stream, as torch requires
            for _ in range(self.warmup):
                run()
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        # checked on this thread only: TensorRT-RTX compiles prefill kernels on threads of its own
        # (lazy specialization), which may call CUDA while a decode step is being captured
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            static_outputs = run()
        return graph, static_inputs, list(static_outputs)

    def clear(self) -> None:
        """Drop every graph (they hold addresses of buffers that are about to be replaced)."""
        self.graphs.clear()


class Caches:
    """KV caches that keep their addresses across requests, as captured graphs need. They are
    allocated for the largest batch so far (``allocate(batch) -> {step: [tensor, ...]}``, batch
    first); a request for ``batch`` sequences uses the first ``batch`` of each, a contiguous prefix
    at the same address, zeroed in place."""

    def __init__(self, allocate: Callable[[int], dict[str, list[torch.Tensor]]]):
        self.allocate = allocate
        self.full: dict[str, list[torch.Tensor]] = {}
        self.capacity = self.batch = 0

    def start(self, batch: int) -> bool:
        """Empty caches for ``batch`` sequences; True when they were allocated anew, so graphs
        captured on the old ones must be dropped."""
        grown = batch > self.capacity
        if grown:
            self.full, self.capacity = self.allocate(batch), batch
        else:
            for tensors in self.full.values():
                for tensor in tensors:
                    tensor[:batch].zero_()
        self.batch = batch
        return grown

    def __getitem__(self, step: str) -> list[torch.Tensor]:
        """``step``'s caches for the current batch."""
        return [tensor[: self.batch] for tensor in self.full[step]]
