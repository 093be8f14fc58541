"""The draft's greedy acceptance (tau) on held-out prompts, measured on the draft as saved."""
from __future__ import annotations

from pathlib import Path

from export.draft_model import load_draft
from export.target_model import TargetStep
from runtime.backend import capacity_needed
from runtime.speculative import generate
from runtime.torch_backend import TorchBackend


def measure_tau(target: TargetStep, out: Path, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Greedy acceptance (tokens per verify step) of the draft as saved in ``out``, loaded the way
    every consumer loads it."""
    draft = load_draft(out, target)
    capacity = capacity_needed(max(map(len, prompts)), max_new_tokens, k=draft.k,
                               block_size=draft.config.block_size)
    result = generate(TorchBackend(target, draft, capacity), prompts, max_new_tokens=max_new_tokens,
                      eos_token_ids=target.config.eos_token_ids)
    return result.stats.tau
