"""The ``tensorrt`` or ``tensorrt_rtx`` module a backend name stands for, imported with a one-line
error where it is missing: what the engine build and the TensorRT runtime both start from. It
imports neither until asked, so that ``python -m export build`` can check its flags without them."""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from common.errors import EngineBuildError

MODULES = {"trt": "tensorrt", "trt-rtx": "tensorrt_rtx"}    # backend -> the Python module


def import_tensorrt(backend: str):
    """``tensorrt`` or ``tensorrt_rtx``, with a clear message when it is not installed."""
    if backend not in MODULES:
        raise ValueError(f"--backend {backend}: expected one of {', '.join(MODULES)}")
    try:
        trt = importlib.import_module(MODULES[backend])
    except ImportError:
        extra = "trt-rtx" if backend == "trt-rtx" else "trt"
        raise EngineBuildError(f"--backend {backend} needs the {MODULES[backend]} package: "
                               f"pip install -e '.[{extra}]'") from None
    if backend == "trt-rtx":
        ensure_rtx_library_link()
    return trt


def ensure_rtx_library_link() -> None:
    """The TensorRT-RTX wheel ships ``libtensorrt_rtx.so.1`` but not the ``libtensorrt_rtx.so``
    name that plugin parsing loads; create the link next to it, or explain how."""
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or not spec.submodule_search_locations:
        return
    folder = Path(next(iter(spec.submodule_search_locations)))
    link, target = folder / "libtensorrt_rtx.so", folder / "libtensorrt_rtx.so.1"
    if link.exists() or not target.exists():
        return
    try:
        link.symlink_to(target.name)
    except OSError as err:
        raise EngineBuildError(f"{link} is missing and could not be created ({err}); TensorRT-RTX "
                               f"plugin parsing needs it: ln -s {target.name} {link}") from None
