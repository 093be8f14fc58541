"""Load a target and its DSpark draft together: the draft's config decides which target layers
the target must tap, so it is read first."""
from __future__ import annotations

from pathlib import Path

import torch

from modeling.checkpoint import resolve
from modeling.dense import TargetStep
from modeling.draft import DraftStep, load_draft
from modeling.draft_config import load_draft_config
from modeling.target import load_target
from modeling.target_config_reader import load_target_config


def load_pair(target: str | Path, draft: str | Path | None = None, k: int | None = None,
              dtype: torch.dtype = torch.float32,
              markov_top_k: int = 0) -> tuple[TargetStep, DraftStep | None]:
    """``(TargetStep, DraftStep)``; with no ``draft``, the target alone and ``None``."""
    target_dir = resolve(target, "target")
    if draft is None:
        return load_target(target_dir, dtype=dtype), None
    draft_dir = resolve(draft, "draft")
    decoder = load_target_config(target_dir).decoder
    taps = load_draft_config(draft_dir, decoder.num_layers, decoder.hidden_size).target_layer_ids
    target_step = load_target(target_dir, taps=taps, dtype=dtype)
    return target_step, load_draft(draft_dir, target_step, k=k, dtype=dtype, markov_top_k=markov_top_k)
