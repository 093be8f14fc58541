"""Speculative decoding over engine directories: ``from runtime import Generator``."""
from .generator import Generation, Generator

__all__ = ["Generation", "Generator"]
