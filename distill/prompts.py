"""The prompts a run trains and is measured on: the first records of each ``--prompts`` file, and
held-out ones from its end, as token ids through the target's chat template."""
from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from common.prompts import (
    TRAINING_RECORD,
    encode_prompt,
    read_jsonl_conversations,
    read_jsonl_prompts,
    training_record,
)
from modeling.checkpoint import hf_location

from .options import DistillSpec


def load_tokenizer(target_dir: Path):
    """The target's tokenizer (directory, GGUF file or hub id)."""
    location, options = hf_location(target_dir)
    return AutoTokenizer.from_pretrained(location, **options)


def read_prompts(spec: DistillSpec,
                 tokenizer) -> tuple[dict[str, list[list[str]]], dict[str, list[list[int]]]]:
    """By the file's name (the first file's first): the user turns of the first ``--num-prompts``
    records of each file short of its last ``--held-out`` (training), and the token ids, through
    the chat template as a user would send them, of the first turn of the first
    ``--eval-prompts`` of each file's held-out records (acceptance)."""
    train, held = {}, {}
    for path in spec.prompts:
        conversations = read_jsonl_conversations(path, "--prompts")
        name = Path(path).stem if Path(path).stem not in held else str(path)
        train[name] = conversations[:_trained(spec, path, conversations)]
        held[name] = [encode_prompt(tokenizer, turns[0])
                      for turns in conversations[len(conversations) - spec.held_out:][:spec.eval_prompts]]
    return train, held


def write_training_record(out: Path, spec: DistillSpec) -> None:
    """``OUT/training.json``: the records of each file that the draft trains on, which
    ``python -m bench`` refuses to measure it on (copy it with the draft's files)."""
    ranges = [(path, _trained(spec, path, read_jsonl_prompts(path, "--prompts"))) for path in spec.prompts]
    about = ("The prompts this draft was distilled on (python -m distill): the first turn of records "
             "[first, end) of each file; python -m bench refuses to measure acceptance on them.")
    (out / TRAINING_RECORD).write_text(json.dumps(training_record(ranges, about), indent=1) + "\n")


def _trained(spec: DistillSpec, path: Path, texts: list[str]) -> int:
    """How many of a file's first records train: ``--num-prompts``, short of its last ``--held-out``."""
    if len(texts) <= spec.held_out:
        raise ValueError(f"--prompts {path} holds {len(texts)} prompts; --held-out {spec.held_out} "
                         f"leaves none to train on")
    return min(spec.num_prompts, len(texts) - spec.held_out)
