"""``TargetStep``: one forward of a dense target LLM (Qwen3, Llama, Qwen3-MoE) over fixed-capacity
KV caches, and the contract every family's step keeps.

The same module serves prefill chunks and verification (``S = k + 1`` rows): flat tensors in and
out, no ``transformers`` cache objects, so it exports to ONNX as it is.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from torch import nn

from modeling.decoder import CachedStep, DecoderLayer, RMSNorm, Rotary, embedded, logits_and_aux
from modeling.moe import SparseMoe

if TYPE_CHECKING:
    from modeling.target_config import TargetConfig


class TargetStep(CachedStep, nn.Module):
    """``input_ids [B, S]``, ``start [B]`` (each row's valid cache length, where its block is
    written; positions are ``start + i``), ``logit_rows [B, L]`` (the rows, ``0 .. S - 1``, of each
    sequence whose logits are wanted), per-layer caches ``k_0, v_0, k_1, ...`` each
    ``[B, Hkv, C, D]`` ->

    - ``logits [B, L, V]``: row ``j`` is the logits of row ``logit_rows[b, j]``;
    - ``aux [B, S, T*H]``: the raw residual stream after each tap layer (DeepSpec convention,
      ``-1`` = embeddings), concatenated in ascending layer order, which is the draft's input;
    - the updated caches.

    The loop reads one row per prompt in prefill and the ``k + 1`` rows of a verify step, so the
    hidden rows are picked before the final norm and ``lm_head``: a 512-row prefill chunk of a
    152k-token vocabulary computes and returns 1 row of logits instead of 512. The rows are an
    input, not a count of last rows, because a ragged batch's prompts end at different rows.
    """

    def __init__(self, config: TargetConfig, taps: Sequence[int] = ()):
        super().__init__()
        d = config.decoder
        self.config = config
        self.taps = tuple(sorted(taps))
        self.embed_tokens = nn.Embedding(config.vocab_size, d.hidden_size)
        sparse = config.moe.sparse_layers if config.moe else (False,) * d.num_layers
        self.layers = nn.ModuleList(DecoderLayer(d, SparseMoe(d, config.moe) if sparse[i] else None)
                                    for i in range(d.num_layers))
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.lm_head = nn.Linear(d.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(d)

    def forward(self, input_ids, start, logit_rows, *caches):
        h, cos, sin, aux = embedded(self, input_ids, start)
        new_caches = []
        for index, layer in enumerate(self.layers):
            h, k, v = layer(h, cos, sin, caches[2 * index], caches[2 * index + 1], start, causal=True)
            new_caches += [k, v]
            if index in self.taps:
                aux.append(h)
        return *logits_and_aux(h, aux, logit_rows, self.norm, self.lm_head.weight), *new_caches
