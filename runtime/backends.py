"""Choosing a backend by name for an engine directory."""
from __future__ import annotations

from pathlib import Path

BACKENDS = ("ort", "torch")


def open_backend(engine: str | Path, name: str = "ort", threads: int | None = None):
    """``ort``: ONNX Runtime on the CPU over the engine's graphs (the default); ``torch``: the
    PyTorch reference modules (reads the source checkpoints; for tests and comparisons)."""
    if name == "ort":
        from .ort_backend import OrtBackend

        return OrtBackend(engine, threads=threads)
    if name == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend.from_engine(engine)
    raise ValueError(f"--backend {name}: expected one of {', '.join(BACKENDS)}")
