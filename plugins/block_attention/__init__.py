"""``dspark::BlockAttention``: a block of queries over a fixed-capacity KV cache."""
from .reference import block_attention

__all__ = ["block_attention"]
