"""The registry of model families: architecture name -> ``Architecture`` -> ``Family``, the one
place that says which checkpoints the engine takes and, for each, how its config is read and which
step module computes it; and DSpark draft class -> ``DraftFamily`` (``DRAFTS``), how a draft's
backbone is read and made. ``target_config_reader``, ``draft_config``, ``draft``, the manifest
schema's architecture lists (a test keeps them equal) and ``make-tiny`` read it; a new family is
one entry here and its module."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from modeling import dense, gemma4
from modeling.decoder import DecoderConfig
from modeling.dense import TargetStep
from modeling.gemma4 import (
    SHAPE_FIELDS,
    SLIDING,
    Gemma4Layout,
    Gemma4TargetStep,
    check_unused,
    layout_from_hf,
    moe_from_hf,
)
from modeling.moe import MOE_FIELDS, MoeConfig
from modeling.qwen3_5 import FULL, LINEAR, HybridTargetStep, LinearAttentionConfig, check_layer_types

# the hybrid's shape fields beyond the dense decoder's
LINEAR_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads")


@dataclass(frozen=True)
class Parts:
    """What a family's config reader makes of a ``transformers`` text config: the decoder and the
    family's config parts, each a field of ``TargetConfig`` of the same name (the manifest's
    ``target`` sections)."""
    decoder: DecoderConfig
    linear: LinearAttentionConfig | None = None   # a hybrid's linear-attention layers
    moe: MoeConfig | None = None                    # a MoE target's sparse blocks
    gemma4: Gemma4Layout | None = None              # a Gemma 4 target's layers beyond decoder's


@dataclass(frozen=True)
class DraftFamily:
    """A DSpark draft class (a native config's ``architectures`` entry): its backbone's reader,
    (the config's dict, its path, the field prefix where the backbone sits) -> (``DecoderConfig``,
    vocab_size, max_position_embeddings, the ``DraftConfig`` fields it sets), raising a
    ``CheckpointError`` that names the field; and its modules, ``DraftConfig`` -> ``DraftBackbone``."""
    read: Callable[..., tuple]
    backbone: Callable


QWEN3_DRAFT = "Qwen3DSparkModel"   # the draft DeepSpec trains for most families, and ``distill`` too
GEMMA4_DRAFT = "Gemma4DSparkModel"
# Speculators' DSpark drafts have a Qwen3 backbone too
DRAFTS: dict[str, DraftFamily] = {QWEN3_DRAFT: DraftFamily(dense.read_draft, dense.draft_backbone),
                                  GEMMA4_DRAFT: DraftFamily(gemma4.read_draft, gemma4.draft_backbone)}


@dataclass(frozen=True)
class Family:
    """One family of text models, whichever checkpoint layout holds it."""
    model_type: str                          # its text config's model_type
    read: Callable[[object], Parts]          # transformers text config -> Parts; ValueError names a field
    step: type                               # the step module: ``step(target_config, taps)``
    layer_kinds: tuple[str, ...] = (FULL,)   # the layer_types its layers may have
    fields: tuple[str, ...] = ()             # shape fields beyond the dense decoder's (decoder.check_fields)
    # (tensors, target config, "FILE: field '[text_config.]") -> None; CheckpointError names the field
    check_weights: Callable | None = None    # the checkpoint's tensors, before the module takes them
    check_unused: Callable | None = None     # the tensors the module did not take
    draft: str = QWEN3_DRAFT                 # DeepSpec's native draft class for its targets


@dataclass(frozen=True)
class Architecture:
    """A checkpoint's ``architectures`` entry: its family, and where the text model sits in it."""
    name: str
    family: Family
    model_type: str                          # config.json's model_type
    text_config: str | None = None           # a multimodal checkpoint keeps its text config under this key
    weight_prefix: str = "model."            # ... and its text weights under this prefix


def _dense(qk_norm: bool) -> Callable[[object], Parts]:
    return lambda hf: Parts(DecoderConfig.from_hf(hf, qk_norm=qk_norm))


def _qwen3_moe(hf) -> Parts:
    return Parts(DecoderConfig.from_hf(hf, qk_norm=True), moe=MoeConfig.from_hf(hf, shared_expert=False))


def _hybrid(moe: bool) -> Callable[[object], Parts]:
    def read(hf) -> Parts:
        # Qwen3.5's MLP has no biases whatever mlp_bias says (transformers ignores it)
        decoder = replace(DecoderConfig.from_hf(hf, qk_norm=True, partial_rotary=True), mlp_bias=False)
        linear = LinearAttentionConfig.from_hf(hf)
        if len(linear.layer_types) != decoder.num_layers:
            raise ValueError(f"field 'layer_types' has {len(linear.layer_types)} entries: expected one per "
                             f"layer ({decoder.num_layers}, num_hidden_layers)")
        return Parts(decoder, linear=linear, moe=MoeConfig.from_hf(hf, shared_expert=True) if moe else None)
    return read


def _gemma4(hf) -> Parts:
    decoder, layout = layout_from_hf(hf)
    return Parts(decoder, moe=moe_from_hf(hf), gemma4=layout)


QWEN3 = Family("qwen3", _dense(qk_norm=True), TargetStep)
LLAMA = Family("llama", _dense(qk_norm=False), TargetStep)
QWEN3_MOE = Family("qwen3_moe", _qwen3_moe, TargetStep, fields=MOE_FIELDS)
QWEN3_5 = Family("qwen3_5_text", _hybrid(moe=False), HybridTargetStep, (FULL, LINEAR), LINEAR_FIELDS,
                 check_weights=check_layer_types)
QWEN3_5_MOE = Family("qwen3_5_moe_text", _hybrid(moe=True), HybridTargetStep, (FULL, LINEAR),
                     LINEAR_FIELDS + MOE_FIELDS + ("shared_expert_intermediate_size",),
                     check_weights=check_layer_types)
# Gemma 4 (MoE blocks too: 26B-A4B), and its "unified" form (the 12B: the same text layers without
# per-layer inputs)
GEMMA4 = Family("gemma4_text", _gemma4, Gemma4TargetStep, (FULL, SLIDING), SHAPE_FIELDS,
                check_unused=check_unused, draft=GEMMA4_DRAFT)
GEMMA4_UNIFIED = Family("gemma4_unified_text", _gemma4, Gemma4TargetStep, (FULL, SLIDING), SHAPE_FIELDS,
                        check_unused=check_unused, draft=GEMMA4_DRAFT)

def _multimodal(name: str, family: Family) -> Architecture:
    return Architecture(name, family, family.model_type.removesuffix("_text"), text_config="text_config",
                        weight_prefix="model.language_model.")


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("Qwen3ForCausalLM", QWEN3, "qwen3"),
    Architecture("LlamaForCausalLM", LLAMA, "llama"),
    Architecture("Qwen3MoeForCausalLM", QWEN3_MOE, "qwen3_moe"),
    Architecture("Qwen3_5ForCausalLM", QWEN3_5, "qwen3_5_text"),
    _multimodal("Qwen3_5ForConditionalGeneration", QWEN3_5),
    Architecture("Qwen3_5MoeForCausalLM", QWEN3_5_MOE, "qwen3_5_moe_text"),
    _multimodal("Qwen3_5MoeForConditionalGeneration", QWEN3_5_MOE),
    Architecture("Gemma4ForCausalLM", GEMMA4, "gemma4_text"),
    _multimodal("Gemma4ForConditionalGeneration", GEMMA4),
    Architecture("Gemma4UnifiedForCausalLM", GEMMA4_UNIFIED, "gemma4_unified_text"),
    _multimodal("Gemma4UnifiedForConditionalGeneration", GEMMA4_UNIFIED),
)}


def by_model_type(model_type: str) -> Architecture | None:
    """The architecture ``transformers`` picks for a config without ``architectures``."""
    return next((a for a in ARCHITECTURES.values() if a.model_type == model_type), None)
