"""``TargetStep``: one forward of a dense target LLM (Qwen3, Llama, Qwen3-MoE) over fixed-capacity
KV caches, and the contract every family's step keeps; and the Qwen3 backbone of the DSpark drafts
DeepSpec trains for most families (``Qwen3DSparkModel``, and Speculators' ``dspark``).

The same module serves prefill chunks and verification (``S = k + 1`` rows): flat tensors in and
out, no ``transformers`` cache objects, so it exports to ONNX as it is.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from torch import nn

from modeling.checkpoint import CheckpointError, one_line
from modeling.decoder import (
    CONFIG_ERRORS,
    IGNORED_BACKBONE_FIELDS,
    CachedStep,
    DecoderConfig,
    DecoderLayer,
    DraftBackbone,
    RMSNorm,
    Rotary,
    check_fields,
    embedded,
    logits_and_aux,
)
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

    def weight_units(self) -> list[nn.Module]:
        """The submodules that read their weights only when called: the embedding, the decoder
        layers and ``lm_head``. A build whose target weights stay in the file gives each its own
        while it runs (``lazy_weights.resident``): at 8B the embedding and ``lm_head`` are 2.5 GB
        each in float32."""
        return [self.embed_tokens, *self.layers, self.lm_head]

    def forward(self, input_ids, start, logit_rows, *caches):
        h, cos, sin, aux = embedded(self, input_ids, start)
        new_caches = []
        for index, layer in enumerate(self.layers):
            h, k, v = layer(h, cos, sin, caches[2 * index], caches[2 * index + 1], start, causal=True)
            new_caches += [k, v]
            if index in self.taps:
                aux.append(h)
        return *logits_and_aux(h, aux, logit_rows, self.norm, self.lm_head), *new_caches


def read_draft(backbone: dict, path: Path, field: str = "") -> tuple[DecoderConfig, int, int, dict]:
    """A Qwen3 draft backbone's decoder, vocabulary size and max_position_embeddings, and no
    section of its own; ``field`` says where the backbone sits in the file ("" for a native
    config, ``transformer_layer_config.`` for Speculators')."""
    from transformers import AutoConfig

    model_type = backbone.get("model_type", "qwen3")
    if model_type != "qwen3":
        raise CheckpointError(f"{path}: {field}model_type {model_type!r}: only qwen3 DSpark "
                              f"backbones are supported")
    clean = {k: v for k, v in backbone.items() if k not in IGNORED_BACKBONE_FIELDS}
    try:
        check_fields(clean, "qwen3")
        hf = AutoConfig.for_model("qwen3", **clean)
        decoder = DecoderConfig.from_hf(hf, qk_norm=True)
    except CONFIG_ERRORS as err:
        where = f"{field[:-1]}: " if field else ""
        raise CheckpointError(f"{path}: {where}{one_line(err)}") from None
    return decoder, hf.vocab_size, hf.max_position_embeddings, {}


def draft_backbone(config) -> DraftBackbone:
    """The modules of a draft with ``config`` (a ``DraftConfig``) on Qwen3 decoder layers."""
    d = config.decoder
    return DraftBackbone(nn.Embedding(config.vocab_size, d.hidden_size),
                         RMSNorm(d.hidden_size, d.rms_norm_eps),
                         nn.ModuleList(DecoderLayer(d) for _ in range(d.num_layers)),
                         RMSNorm(d.hidden_size, d.rms_norm_eps))
