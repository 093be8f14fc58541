"""The training forward and its loss: every anchor's block at once, in one dense masked attention,
as inference computes them one anchor at a time."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from export.draft_model import DraftStep


def teacher_forced_logits(draft: DraftStep, aux: torch.Tensor, tokens: torch.Tensor,
                          anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's block logits for every anchor at once, as inference computes them one anchor at
    a time (``DraftStep.write_context`` + ``block_logits`` + the Markov bias), with the true tokens
    as Markov predecessors.

    ``aux [S, T*H]`` are the target's taps of ``tokens [S]``; ``anchors [n]`` are positions.
    Returns ``logits [n, B, V_d]`` (draft space) and ``labels [n, B]``: the target id at
    ``p + j + 1``, or -100 past the end of the sequence."""
    config, block = draft.config, draft.config.block_size
    length, count = tokens.numel(), anchors.numel()
    span = anchors[:, None] + torch.arange(block)                          # [n, B] positions
    seen = int(anchors.max())                                              # context rows any block sees
    context = draft.hidden_norm(draft.fc(aux[None, :seen]))
    ctx_cos, ctx_sin = draft.rotary.cos_sin(torch.arange(seen)[None], context.dtype)
    ids = torch.full((count, block), config.mask_token_id, dtype=torch.long)
    ids[:, 0] = tokens[anchors]
    h = draft.embed_tokens(ids.reshape(1, -1))
    cos, sin = draft.rotary.cos_sin(span.reshape(1, -1), h.dtype)
    mask = block_mask(anchors, seen, block)
    for layer in draft.layers:
        context_kv = layer.self_attn.key_value(context, ctx_cos, ctx_sin)   # skips input_layernorm
        h, _, _ = layer(h, cos, sin, context_kv=context_kv, mask=mask)
    base = draft.lm_head(draft.norm(h)).reshape(count, block, -1)
    predecessors = tokens[span.clamp(max=length - 1)]                      # [anchor, y_1 .. y_{B-1}]
    bias = draft.markov_head.markov_w2(draft.markov_head.markov_w1(predecessors))
    following = span + 1
    labels = torch.where(following < length, tokens[following.clamp(max=length - 1)], -100)
    return base + bias, labels


def block_mask(anchors: torch.Tensor, seen: int, block: int) -> torch.Tensor:
    """``[n*B, seen + n*B]``: a row of anchor ``i``'s block sees the context rows ``< p_i`` and the
    ``B`` rows of its own block (non-causal), nothing of the other blocks."""
    owner = torch.arange(anchors.numel()).repeat_interleave(block)
    sees_context = torch.arange(seen)[None] < anchors.repeat_interleave(block)[:, None]
    return torch.cat([sees_context, owner[:, None] == owner[None]], dim=1)


def block_loss(logits: torch.Tensor, labels: torch.Tensor, to_draft: torch.Tensor | None,
               decay: float | None) -> torch.Tensor:
    """Cross-entropy over the block rows, averaged, row ``j`` weighted ``exp(-j / decay)`` when
    ``decay`` is set (early rows decide acceptance). With a reduced vocabulary the labels move to
    draft ids (``to_draft``); those outside the draft vocabulary cannot be drafted and are skipped."""
    if to_draft is not None:
        labels = torch.where(labels >= 0, to_draft[labels.clamp(min=0)], -100)
    count, block = labels.shape
    rows = torch.arange(block, dtype=torch.float32)
    weight = torch.exp(-rows / decay) if decay else torch.ones(block)
    weight = weight.expand(count, block) * (labels >= 0)
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                         reduction="none")
    return (ce * weight.flatten()).sum() / weight.sum().clamp(min=1e-6)
