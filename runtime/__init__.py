"""Speculative decoding over engine directories: ``from runtime import Generator``.

``Generator`` and ``Generation`` are imported on first use: ``python -m runtime.generate`` imports
this package before its ``main`` runs, and torch and transformers take seconds to import, which
Ctrl-C must be able to interrupt cleanly."""
from __future__ import annotations

__all__ = ["Generation", "Generator"]


def __getattr__(name: str):
    if name in __all__:
        from runtime.decoding import generator

        return getattr(generator, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
