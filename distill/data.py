"""The training data: the target's own greedy answers to the training prompts, which are what the
draft will be asked to predict, cached in ``OUT/data.pt``."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from export.target_model import TargetStep
from runtime.backend import capacity_needed
from runtime.speculative import generate
from runtime.torch_backend import TorchBackend

from .checkpoint import atomic, check_same
from .options import DATA_SETTINGS

GENERATION_BATCH = 16         # prompts the target answers at a time


def prepare_data(path: Path, target: TargetStep, prompts: list[list[int]], max_new_tokens: int,
                 settings: dict, progress: bool) -> dict:
    """``{"prompts", "continuations"}``: the target's own greedy answers, which are what the draft
    will be asked to predict. Cached in ``path`` so that a resumed run does not regenerate them."""
    wanted = {key: settings[key] for key in DATA_SETTINGS}
    if path.is_file():
        data = torch.load(path)
        check_same(data["settings"], wanted, path.parent)
        return data
    continuations: list[list[int]] = [[] for _ in prompts]
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))   # little padding per batch
    batches = range(0, len(prompts), GENERATION_BATCH)
    for begin in tqdm(batches, desc="generating", unit="batch", disable=not progress):
        rows = by_length[begin:begin + GENERATION_BATCH]
        batch = [prompts[i] for i in rows]
        backend = TorchBackend(target, None, capacity_needed(max(map(len, batch)), max_new_tokens))
        result = generate(backend, batch, max_new_tokens=max_new_tokens,
                          eos_token_ids=target.config.eos_token_ids)
        for i, ids in zip(rows, result.token_ids):
            continuations[i] = ids
    data = {"settings": wanted, "prompts": prompts, "continuations": continuations}
    atomic(lambda tmp: torch.save(data, tmp), path)
    return data
