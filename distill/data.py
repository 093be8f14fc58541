"""The training data: the target's own answers to the training prompts, which are what the draft
will be asked to predict: greedy, and ``--samples`` more per prompt sampled at T = 1 (the draft
learns the target's distribution, not one path), cached in ``OUT/data.pt``."""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from export.target_model import TargetStep
from runtime.backend import capacity_needed
from runtime.speculative import generate
from runtime.torch_backend import TorchBackend

from . import engine as engine_target
from .checkpoint import atomic, check_same
from .options import DATA_SETTINGS

GENERATION_BATCH = 16         # prompts the PyTorch target answers at a time


def prepare_data(path: Path, target: TargetStep, prompts: list[list[int]], max_new_tokens: int,
                 samples: int, settings: dict, progress: bool, engine=None) -> dict:
    """``{"prompts", "continuations"}``: each prompt's greedy answer, then ``samples`` rounds of
    answers at T = 1 (prompt ``i`` of round ``r`` seeded ``r * len(prompts) + i``), one record per
    answer; through ``engine`` (``distill.engine.open_engine``) where given, else the PyTorch
    target. Cached in ``path`` so that a resumed run does not regenerate them; ``generation``
    records tokens and seconds."""
    def make() -> dict:
        began, continuations = time.perf_counter(), []
        for round_ in range(samples + 1):
            temperature, seed = (0.0, 0) if round_ == 0 else (1.0, round_ * len(prompts))
            continuations += _answers(target, engine, prompts, max_new_tokens, temperature, seed, progress)
        generation = {"tokens": sum(map(len, continuations)), "seconds": time.perf_counter() - began}
        return {"prompts": prompts * (samples + 1), "continuations": continuations, "generation": generation}

    return _cached(path, {key: settings[key] for key in DATA_SETTINGS}, make)


def prepare_held_out(path: Path, target: TargetStep, sets: dict[str, list[list[int]]], max_new_tokens: int,
                     settings: dict, progress: bool, engine=None) -> dict[str, dict]:
    """``{set: {"prompts", "continuations"}}``: the target's greedy answers to each file's held-out
    prompts (``prompts.read_prompts``), which acceptance is measured on during training; cached in
    ``path`` as the training data is, with ``settings``' ``eval_prompts`` too."""
    def make() -> dict:
        return {"sets": {name: {"prompts": prompts,
                                "continuations": _answers(target, engine, prompts, max_new_tokens, 0.0, 0, progress)}
                         for name, prompts in sets.items() if prompts}}

    wanted = {key: settings[key] for key in (*DATA_SETTINGS, "eval_prompts")}
    return _cached(path, wanted, make)["sets"]


def _cached(path: Path, wanted: dict, make) -> dict:
    """``make()``'s dict, saved in ``path`` with the settings ``wanted``; read back from there when
    a run with the same settings wrote it (another run's is refused)."""
    if path.is_file():
        data = torch.load(path)
        check_same(data["settings"], wanted, path.parent)
        return data
    data = {"settings": wanted, **make()}
    atomic(lambda tmp: torch.save(data, tmp), path)
    return data


def _answers(target: TargetStep, engine, prompts: list[list[int]], max_new_tokens: int, temperature: float,
             seed: int, progress: bool) -> list[list[int]]:
    if engine is not None:
        return engine_target.answers(engine, prompts, max_new_tokens, temperature, seed, progress)
    return _torch_answers(target, prompts, max_new_tokens, temperature, seed, progress)


def _torch_answers(target: TargetStep, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                   seed: int, progress: bool) -> list[list[int]]:
    """The PyTorch target's answers, ``GENERATION_BATCH`` prompts of similar length at a time; the
    ``n``-th prompt by length samples from ``seed + n``."""
    continuations: list[list[int]] = [[] for _ in prompts]
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))   # little padding per batch
    batches = range(0, len(prompts), GENERATION_BATCH)
    for begin in tqdm(batches, desc="generating", unit="batch", disable=not progress):
        rows = by_length[begin:begin + GENERATION_BATCH]
        batch = [prompts[i] for i in rows]
        backend = TorchBackend(target, None, capacity_needed(max(map(len, batch)), max_new_tokens))
        result = generate(backend, batch, max_new_tokens=max_new_tokens, temperature=temperature,
                          seed=seed + begin, eos_token_ids=target.config.eos_token_ids)
        for i, ids in zip(rows, result.token_ids):
            continuations[i] = ids
    return continuations
