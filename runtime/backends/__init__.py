"""Engine directory -> backend: the one ``Backend`` protocol every loop drives (``base``), chosen by
name here: ONNX Runtime (``ort``), the PyTorch modules (``pytorch``, with CUDA graphs on a GPU) or
TensorRT (``trt``)."""
from __future__ import annotations

from pathlib import Path

BACKENDS = ("ort", "torch", "torch-cuda", "trt", "trt-rtx")
GPU_BACKENDS = ("torch-cuda", "trt", "trt-rtx")   # one GPU each (a Triton KIND_GPU instance, a Ray num_gpus)


def open_backend(engine: str | Path, name: str = "ort", threads: int | None = None):
    """``ort``: ONNX Runtime on the CPU over the engine's graphs (the default); ``torch``: the
    PyTorch reference modules (reads the source checkpoints; for tests and comparisons);
    ``torch-cuda``: the same on a CUDA GPU with CUDA graphs; ``trt`` / ``trt-rtx``: the engine's
    TensorRT or TensorRT-RTX engines on a CUDA GPU, with CUDA graphs. Where torch sees no GPU,
    ``torch-cuda`` is refused before the modules load (``TrtBackend`` refuses once it has checked
    that the engine has its engines)."""
    if name == "torch-cuda":
        import torch

        if not torch.cuda.is_available():
            why = "this torch is a CPU build" if torch.version.cuda is None else "torch sees no CUDA device"
            raise ValueError(f"--backend {name} needs a CUDA GPU ({why}); use --backend ort on the CPU")
    if name == "ort":
        from runtime.backends.ort import OrtBackend

        return OrtBackend(engine, threads=threads)
    if name == "torch":
        from runtime.backends.pytorch import TorchBackend

        return TorchBackend.from_engine(engine)
    if name == "torch-cuda":
        from runtime.backends.pytorch import TorchBackend

        return TorchBackend.from_engine(engine, device="cuda", cuda_graphs=True)
    if name in ("trt", "trt-rtx"):
        from runtime.backends.trt import TrtBackend

        return TrtBackend(engine, backend=name)
    raise ValueError(f"--backend {name}: expected one of {', '.join(BACKENDS)}")
