"""Turning target logits into a distribution, and the token that a Gumbel vector picks from it."""
from __future__ import annotations

import numpy as np
import torch


def probabilities(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                  top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    """``softmax(logits / temperature)`` in fp32, restricted to the ``top_k`` most likely ids
    (0: all; ties at the k-th value all stay), then to the top-p nucleus, then to the ids at least
    ``min_p`` times as likely as the most likely one: ``transformers``' order."""
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -torch.inf)
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep every token whose preceding mass is below top_p (so the top token always stays)
        keep_sorted = sorted_probs.cumsum(-1) - sorted_probs < top_p
        probs = probs * torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs / probs.sum(-1, keepdim=True)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value (the first of equal ones, as ``torch.argmax``). On a
    CPU, numpy's: torch's CPU ``argmax`` over a 49k vocabulary takes ~10x as long (210 us for a
    5-row verify block on a 2-core EPYC, 19 us), most of a speculative step's extra host work."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float16):
        return logits.argmax(-1)
    return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(-1)))


def scores(logits: torch.Tensor, noise: torch.Tensor, temperature: float, top_p: float = 1.0,
           top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    """``log p + noise`` up to a constant per row, ``-inf`` where ``p`` (``probabilities``) is 0:
    its argmax is the sample of ``p`` that the Gumbel ``noise [..., V]`` picks (``noise.py``)."""
    probs = probabilities(logits, temperature, top_p, top_k, min_p)
    return torch.where(probs > 0, logits.float() / temperature, -torch.inf) + noise


def next_token(logits: torch.Tensor, temperature: float, top_p: float, noise: torch.Tensor | None,
               top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    """Greedy (``temperature == 0``) or sampled next token of each row of ``logits [..., V]``,
    the sample that the Gumbel ``noise [..., V]`` picks."""
    if temperature == 0:
        return argmax(logits)
    return argmax(scores(logits, noise, temperature, top_p, top_k, min_p))
