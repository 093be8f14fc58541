"""What quantizing costs (``build --weights``, ``inspect``): the quantized target's teacher-forced
top-1 agreement with the float one, and both perplexities, on held-out prompts.
"""
from __future__ import annotations

import math

import torch

from modeling.target import from_start

# the quality cost is measured on the prompts the demo draft's distillation held out (the last 20
# records of the file), token by token, at most this many tokens per prompt
QUALITY_HELD_OUT, QUALITY_MAX_TOKENS = 20, 256


def held_out_texts(tokenizer, max_tokens: int) -> list[list[int]] | None:
    """Token ids of the held-out prompts the quality cost is measured on (no chat template), each
    cut to ``max_tokens``; None when the prompt file is not there (an installed package)."""
    from common.prompts import DEFAULT_PROMPTS, read_jsonl_prompts

    if not DEFAULT_PROMPTS.is_file():
        return None
    prompts = read_jsonl_prompts(DEFAULT_PROMPTS, "prompts")[-QUALITY_HELD_OUT:]
    ids = [tokenizer.encode(text, add_special_tokens=False)[:max_tokens] for text in prompts]
    return [i for i in ids if len(i) > 1]


def teacher_forced(target, texts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-1 prediction and the negative log-likelihood of the true next token at
    every position of ``texts`` (each one sequence from position 0), concatenated."""
    predictions = []
    with torch.no_grad():
        for ids in texts:
            rows = torch.arange(len(ids) - 1)[None]
            logits = from_start(target, torch.tensor([ids]), rows)[0][0]
            predictions.append(next_token_predictions(logits, ids))
    return tuple(torch.cat(part) for part in zip(*predictions))


def next_token_predictions(logits: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """From ``logits [len(ids) - 1, V]`` (row ``i`` predicts ``ids[i + 1]``): the top-1 prediction
    and the true next token's negative log-likelihood at each row."""
    logits = logits.float()
    return logits.argmax(-1), -torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def quality_cost(reference: tuple[torch.Tensor, torch.Tensor],
                 quantized: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Teacher-forced top-1 agreement of the quantized target with the unquantized one, and both
    perplexities, from ``teacher_forced`` of each on the same texts."""
    return {"tokens": int(reference[0].numel()),
            "top1_agreement": float((reference[0] == quantized[0]).float().mean()),
            "perplexity": {"reference": math.exp(float(reference[1].mean())),
                           "quantized": math.exp(float(quantized[1].mean()))}}
