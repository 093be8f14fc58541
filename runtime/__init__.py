"""Speculative decoding over engine directories: ``from runtime import Generator`` (and, for
continuous batching, ``Params`` and ``Batcher``).

These are imported on first use: ``python -m runtime.generate`` imports this package before its
``main`` runs, and torch and transformers take seconds to import, which Ctrl-C must be able to
interrupt cleanly."""
from __future__ import annotations

import importlib

# name -> the module that defines it
_HOMES = {"Generation": "runtime.decoding.generator", "Generator": "runtime.decoding.generator",
          "Params": "runtime.decoding.params", "Batcher": "runtime.decoding.batcher"}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
