"""Turning target logits into a distribution, drawing from it, and the draft's Gumbel noise."""
from __future__ import annotations

import torch


def probabilities(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """``softmax(logits / temperature)`` in fp32, restricted to the top-p nucleus."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # keep every token whose preceding mass is below top_p (so the top token always stays)
    keep_sorted = sorted_probs.cumsum(-1) - sorted_probs < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One sample per row of ``probs [..., V]``."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def next_token(logits: torch.Tensor, temperature: float, top_p: float,
               generator: torch.Generator) -> torch.Tensor:
    """Greedy (``temperature == 0``) or sampled next token of each row of ``logits [..., V]``."""
    if temperature == 0:
        return logits.argmax(-1)
    return draw(probabilities(logits, temperature, top_p), generator)


def gumbel_noise(shape, generator: torch.Generator) -> torch.Tensor:
    """``-log(-log(U))``: ``argmax(z / T + noise)`` is then a sample of ``softmax(z / T)``."""
    uniform = torch.rand(shape, generator=generator, device=generator.device).clamp_(1e-20, 1.0 - 1e-7)
    return -torch.log(-torch.log(uniform))
