"""``torch.ops.dspark.cache_write``: the reference as an opaque custom op, so that ``torch.export``
keeps it as one node for the ONNX exporter to translate."""
from __future__ import annotations

import torch

from .reference import cache_write as reference


@torch.library.custom_op("dspark::cache_write", mutates_args=())
def cache_write(cache: torch.Tensor, new: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    return reference(cache, new, start)


@cache_write.register_fake
def _(cache, new, start):
    return torch.empty_like(cache)
