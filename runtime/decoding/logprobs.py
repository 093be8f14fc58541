"""Log-probabilities of tokens under the target, as OpenAI's ``logprobs`` reports them: the model's
own distribution (``log_softmax`` of its logits, before temperature, penalties or truncation:
vLLM's default ``raw_logprobs``), from the rows a step already computed. A verify row's logits are
those the row gets alone (``runtime/backends/ort.py``), so a token's log-probability is the same with
speculation as without."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the ``top`` most likely ids at its position, with theirs."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Row ``i`` of ``logits [R, V]`` predicts ``tokens[i]`` (``len(tokens) <= R``)."""
    rows = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = rows.gather(-1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0].tolist()
    values, ids = rows.topk(top, dim=-1) if top else (rows[:, :0], rows[:, :0].long())
    return [TokenLogprob(token, logprob, tuple(zip(i, v)))
            for token, logprob, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]
