"""``dspark::D2TGather``: pick a draft id, map it to a target id, fetch its Markov row."""
from .reference import d2t_gather

__all__ = ["d2t_gather"]
