"""CUDA-graph capture and replay of a step function, shared by the TensorRT backend and the
PyTorch backend on CUDA.

One graph per key (phase and the sizes of the step's dynamic axes: batch, rows, logit rows): the
step's per-call inputs are copied into static buffers, the graph replays, and its static outputs
are returned. State the step updates in place (the KV caches) is passed by reference and captured
as it is. Our steps are idempotent for equal inputs (they write the same cache rows), so the
warm-up runs before capture change nothing.
"""
from __future__ import annotations

from typing import Callable, Hashable

import torch


class GraphCache:
    def __init__(self, step: Callable[..., list[torch.Tensor]], warmup: int = 2):
        self.step, self.warmup = step, warmup
        self.graphs: dict[Hashable, tuple] = {}

    def __call__(self, key: Hashable, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if key not in self.graphs:
            self.graphs[key] = self._capture(inputs)
        graph, static_inputs, static_outputs = self.graphs[key]
        for buffer, value in zip(static_inputs, inputs):
            buffer.copy_(value, non_blocking=True)
        graph.replay()
        return static_outputs

    def _capture(self, inputs: list[torch.Tensor]):
        static_inputs = [value.clone() for value in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch requires
            for _ in range(self.warmup):
                self.step(*static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_outputs = self.step(*static_inputs)
        return graph, static_inputs, list(static_outputs)

    def clear(self) -> None:
        """Drop every graph (they hold addresses of buffers that are about to be replaced)."""
        self.graphs.clear()
