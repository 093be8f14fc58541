"""The training data: the target's own answers to the training prompts, which are what the draft
will be asked to predict: greedy, and ``--samples`` more per prompt sampled at T = 1 (the draft
learns the target's distribution, not one path), to more prompts than the files hold
(``synthetic.py``), cached in ``OUT/data.pt``; and its greedy answers to the held-out prompts
that acceptance is measured on during training, in ``OUT/held_out.pt``."""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from common.prompts import encode_prompt
from modeling.dense import TargetStep
from runtime.backends.base import capacity_needed
from runtime.backends.pytorch import TorchBackend
from runtime.decoding.batch import generate

from . import engine as engine_target
from . import synthetic
from .checkpoint import atomic, check_same
from .options import DATA_SETTINGS, DistillSpec

GENERATION_BATCH = 16         # prompts the PyTorch target answers at a time


def prepare_data(path: Path, target: TargetStep, tokenizer, records: dict[str, list[list[str]]],
                 spec: DistillSpec, settings: dict, engine=None) -> dict:
    """``{"prompts", "continuations"}``, one record per answer: the first turns of ``records``
    (each file's training conversations) and ``--synthetic`` prompts per file that the target
    writes (``synthetic.py``), each answered greedily and ``--samples`` more times at T = 1
    (round ``r`` seeded ``r * prompts``); with ``--follow-ups``, each conversation's second
    turn on its greedy answer, answered greedily. Through ``engine`` (``distill.engine``) where
    given, else the PyTorch target. Cached in ``path`` so that a resumed run does not regenerate
    them; ``generation`` records tokens and seconds."""
    def answer(prompts: list[list[int]], temperature: float, seed: int) -> list[list[int]]:
        return _answers(target, engine, prompts, spec.max_new_tokens, temperature, seed, spec.progress)

    def make() -> dict:
        began = time.perf_counter()
        conversations = [turns for name in records for turns in records[name]]
        if spec.synthetic:
            firsts = {name: [turns[0] for turns in records[name]] for name in records}
            written = synthetic.written_prompts(answer, tokenizer, firsts, spec.synthetic, spec.seed)
            conversations += [[text] for name in written for text in written[name]]
        prompts = [encode_prompt(tokenizer, turns[0]) for turns in conversations]
        continuations = []
        for round_ in range(spec.samples + 1):
            temperature, seed = (0.0, 0) if round_ == 0 else (1.0, round_ * len(prompts))
            continuations += answer(prompts, temperature, seed)
        greedy, prompts = continuations[:len(prompts)], prompts * (spec.samples + 1)
        if spec.follow_ups:
            second = synthetic.follow_ups(tokenizer, conversations, greedy)
            prompts, continuations = prompts + second, continuations + answer(second, 0.0, 0)
        generation = {"tokens": sum(map(len, continuations)), "seconds": time.perf_counter() - began}
        return {"prompts": prompts, "continuations": continuations, "generation": generation}

    return _cached(path, {key: settings[key] for key in DATA_SETTINGS}, make)


def prepare_held_out(path: Path, target: TargetStep, sets: dict[str, list[list[int]]], spec: DistillSpec,
                     settings: dict, engine=None) -> dict[str, dict]:
    """``{set: {"prompts", "continuations"}}``: the target's greedy answers to each file's held-out
    prompts (``prompts.read_prompts``), which acceptance is measured on during training; cached in
    ``path`` as the training data is, with ``--eval-prompts`` too."""
    def make() -> dict:
        def greedy(prompts):
            return _answers(target, engine, prompts, spec.max_new_tokens, 0.0, 0, spec.progress)
        return {"sets": {name: {"prompts": prompts, "continuations": greedy(prompts)}
                         for name, prompts in sets.items() if prompts}}

    wanted = {key: settings[key] for key in DATA_SETTINGS} | {"eval_prompts": spec.eval_prompts}
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
    """The target's answers through ``engine`` where given, else the PyTorch target."""
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
