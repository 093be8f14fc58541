"""The DSpark draft's configuration: native DeepSpec and Speculators configs, translated to one
dataclass and checked against the target.

Conventions (``docs/dspark.md#target-taps``, ``#block-layouts-and-k``):

- ``target_layer_ids`` uses the **DeepSpec convention**: id ``t`` taps the raw residual stream
  *after* target decoder layer ``t`` (0-based); ``-1`` taps the embedding output. Speculators'
  ``aux_hidden_state_layer_ids`` are vLLM capture ids (the input of layer ``a``), so ``t = a - 1``.
- ``layout`` is ``anchor-first`` (block ``[anchor, MASK...]``, row ``j`` predicts position
  ``p_anchor + j + 1``, ``block_size`` drafts) or ``bonus-anchor`` (same block, row 0 is not
  sampled, row ``j`` predicts ``p_anchor + j``, ``block_size - 1`` drafts). Both draft the
  positions ``p_anchor + 1 ... p_anchor + k``.
- A native config may nest ``mask_token_id`` and ``target_layer_ids`` in ``dflash_config`` or
  ``eagle_config``; they are read where vLLM reads them: ``dflash_config``, then ``eagle_config``,
  then the top level.
- ``logit_scale`` (default 1) multiplies the draft's logits, the Markov bias included, as vLLM's
  logits processor does; the loader folds it into ``lm_head`` and ``markov_w2``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from modeling.checkpoint import CheckpointError, read_config
from modeling.decoder import LARGEST_DIMENSION, DecoderConfig, is_int, is_positive_number
from modeling.gemma4 import Gemma4Draft
from modeling.layouts import ANCHOR_FIRST, BONUS_ANCHOR, check_k, max_drafts
from modeling.registry import DRAFTS, QWEN3_DRAFT

BLOCK_SIZE = "trained block width, at most the draft's max_position_embeddings"
# target config keys a Qwen3 draft must not inherit
NOT_INHERITED = ("auto_map", "quantization_config", "_name_or_path", "_model_name_or_path",
                 "transformers_version", "mlp_bias", "pretraining_tp", "dtype", "torch_dtype",
                 "tie_word_embeddings", "logit_scale")
# where vLLM reads a native draft's nestable fields, first to last
NESTED_SECTIONS = ("dflash_config", "eagle_config")


@dataclass(frozen=True)
class DraftConfig:
    architecture: str                   # the draft class (registry.DRAFTS): its backbone
    source_format: str                  # "native" (DeepSpec) or "speculators"
    decoder: DecoderConfig
    vocab_size: int                     # V: rows of embed_tokens and markov_w1 (indexed by target ids)
    draft_vocab_size: int               # V_d: rows of lm_head and markov_w2
    target_layer_ids: tuple[int, ...]   # DeepSpec convention, ascending
    target_hidden_size: int
    block_size: int                     # trained block width (positions, anchor included)
    layout: str
    mask_token_id: int
    markov_rank: int
    default_k: int | None               # Speculators' speculative_tokens, if the config names one
    logit_scale: float                  # multiplies the logits and the Markov bias
    gemma4: Gemma4Draft | None = None   # a Gemma 4 backbone's numerics (None: Qwen3's)

    @property
    def max_drafts(self) -> int:
        """Drafts one block can propose: every position (anchor-first) or every one but the anchor's."""
        return max_drafts(self.block_size, self.layout)

    @property
    def first_draft_row(self) -> int:
        """Block row that holds the first draft's logits."""
        return 0 if self.layout == ANCHOR_FIRST else 1


def load_draft_config(directory: Path, target_num_layers: int, target_hidden_size: int) -> DraftConfig:
    raw = read_config(directory)
    path = directory / "config.json"
    if "speculators_model_type" in raw:
        config = _from_speculators(raw, path, target_hidden_size, target_num_layers)
    elif isinstance(raw.get("architectures"), list) and set(DRAFTS) & set(raw["architectures"]):
        config = _from_native(raw, path, target_hidden_size, target_num_layers)
    else:
        native = " or ".join(f"['{name}']" for name in DRAFTS)
        raise CheckpointError(
            f"{path}: not a DSpark draft: expected architectures {native} (native DeepSpec) or "
            f"speculators_model_type 'dspark' (Speculators), got architectures {raw.get('architectures')}")
    if config.target_hidden_size != target_hidden_size:
        raise CheckpointError(f"{path}: target_hidden_size {config.target_hidden_size} does not match "
                              f"the target's hidden_size {target_hidden_size}")
    if config.mask_token_id >= config.vocab_size:
        raise CheckpointError(f"{path}: mask_token_id {config.mask_token_id} is outside the "
                              f"vocabulary (vocab_size {config.vocab_size})")
    if config.default_k is not None and config.default_k > config.max_drafts:
        raise CheckpointError(f"{path}: speculators_config.proposal_methods[0].speculative_tokens "
                              f"{config.default_k} exceeds the {config.max_drafts} drafts a "
                              f"block_size {config.block_size} ({config.layout}) block proposes")
    return config


def native_config(target: dict, *, layers: int, block_size: int, taps, mask_token_id: int,
                  markov_rank: int, num_anchors: int, draft_vocab_size: int | None = None,
                  confidence_head: bool = False, bonus_anchor: bool = False) -> dict:
    """What ``load_draft_config`` reads back as a native draft: a copy of the target's config.json
    ``target`` (which names its ``num_hidden_layers`` and backbone shape) less ``NOT_INHERITED``,
    with a ``layers``-layer Qwen3 backbone and the DSpark fields set; ``taps`` in the DeepSpec
    convention (``docs/dspark.md#checkpoint-and-config-conventions``)."""
    config = {k: v for k, v in copy.deepcopy(target).items() if k not in NOT_INHERITED}
    config.update(
        architectures=["Qwen3DSparkModel"], model_type="qwen3", num_target_layers=target["num_hidden_layers"],
        num_hidden_layers=layers, layer_types=["full_attention"] * layers, attention_bias=False,
        hidden_act="silu", tie_word_embeddings=False, target_layer_ids=list(taps), block_size=block_size,
        mask_token_id=mask_token_id, num_anchors=num_anchors, markov_rank=markov_rank,
        markov_head_type="vanilla", enable_confidence_head=confidence_head)
    if confidence_head:
        config["confidence_head_with_markov"] = True
    if draft_vocab_size is not None:
        config["draft_vocab_size"] = draft_vocab_size
    if bonus_anchor:
        config["dspark_bonus_anchor"] = True
    return config


def resolve_k(config: DraftConfig, k: int | None) -> int:
    """Drafts per step: the trained number by default; fewer run the full block and keep the
    first ``k`` proposals; more are refused because rows past the block were never trained
    (``docs/dspark.md#block-layouts-and-k``)."""
    if k is None:
        k = config.default_k if config.default_k is not None else config.max_drafts
    check_k(k, config.block_size, config.layout)
    return k


def _require(raw: dict, key: str, path: Path, what: str):
    if key not in raw:
        raise CheckpointError(f"{path}: missing field '{key}' ({what})")
    return raw[key]


def _int_field(raw: dict, key: str, path: Path, what: str, minimum: int,
               maximum: int = LARGEST_DIMENSION, default: int | None = None) -> int:
    value = raw.get(key, default) if default is not None else _require(raw, key, path, what)
    if not is_int(value) or not minimum <= value <= maximum:
        raise CheckpointError(f"{path}: field '{key}' = {value!r}: expected an integer from {minimum} "
                              f"to {maximum} ({what})")
    return value


def _optional_int(raw: dict, key: str, path: Path, what: str, fallback: int) -> int:
    """``raw[key]``, an integer >= 1, or ``fallback`` where the field is absent or null."""
    return fallback if raw.get(key) is None else _int_field(raw, key, path, what, 1)


def _bool_field(raw: dict, key: str, path: Path, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"{path}: field '{key}' = {value!r}: expected true or false")
    return value


def _markov(raw: dict, path: Path, rank_default=None, type_default="vanilla") -> int:
    head_type = raw.get("markov_head_type", type_default)
    if head_type != "vanilla":
        raise CheckpointError(f"{path}: markov_head_type {head_type!r}: only 'vanilla' is "
                              f"supported at inference (as in vLLM)")
    rank = raw.get("markov_rank", rank_default)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise CheckpointError(f"{path}: markov_rank {rank!r}: expected an integer >= 1 "
                              f"(markov_rank 0 is a plain DFlash draft, which is not supported)")
    return rank


def _nested(raw: dict, key: str, path: Path) -> tuple[dict, str]:
    """``({label: value}, label)`` for a field a native config may nest, from the first of
    ``NESTED_SECTIONS`` that has it, else the top level (``{}`` where none has it); the label names
    the section, as ``dflash_config.mask_token_id``."""
    for section in NESTED_SECTIONS:
        nested = raw.get(section)
        if nested is not None and not isinstance(nested, dict):
            raise CheckpointError(f"{path}: field '{section}' = {nested!r}: expected an object")
        if nested and key in nested:
            return {f"{section}.{key}": nested[key]}, f"{section}.{key}"
    return {key: raw[key]} if key in raw else {}, key


def _logit_scale(raw: dict, path: Path, field: str) -> float:
    value = raw.get("logit_scale", 1.0)
    if not is_positive_number(value):
        raise CheckpointError(f"{path}: field '{field}logit_scale' = {value!r}: expected a number > 0 "
                              f"(it multiplies the draft's logits)")
    return float(value)


def _from_native(raw: dict, path: Path, target_hidden_size: int, target_num_layers: int) -> DraftConfig:
    architecture = next(name for name in raw["architectures"] if name in DRAFTS)
    decoder, vocab, positions, sections = DRAFTS[architecture].read(raw, path, "")
    taps_source, taps_field = _nested(raw, "target_layer_ids", path)
    taps = _require(taps_source, taps_field, path, "DeepSpec tap layers")
    mask_source, mask_field = _nested(raw, "mask_token_id", path)
    bonus = _bool_field(raw, "dspark_bonus_anchor", path,
                        not _bool_field(raw, "sample_from_anchor", path, True))
    config = DraftConfig(
        architecture=architecture,
        source_format="native",
        decoder=decoder,
        vocab_size=vocab,
        draft_vocab_size=_optional_int(raw, "draft_vocab_size", path, "draft vocabulary", vocab),
        target_layer_ids=_taps(taps, path, taps_field, shift=0),
        target_hidden_size=_optional_int(raw, "target_hidden_size", path, "the target's hidden size",
                                         target_hidden_size),
        block_size=_int_field(raw, "block_size", path, BLOCK_SIZE, 2, maximum=positions),
        layout=BONUS_ANCHOR if bonus else ANCHOR_FIRST,
        mask_token_id=_int_field(mask_source, mask_field, path, "MASK token of the block", 0),
        markov_rank=_markov(raw, path),
        default_k=None,
        logit_scale=_logit_scale(raw, path, ""),
        **sections,
    )
    _check_taps(config.target_layer_ids, path, target_num_layers, taps_field, shift=0)
    if "eagle_aux_hidden_state_layer_ids" in raw:
        _check_capture_ids(raw["eagle_aux_hidden_state_layer_ids"], config.target_layer_ids, path,
                           taps_field)
    return config


def _from_speculators(raw: dict, path: Path, target_hidden_size: int,
                      target_num_layers: int) -> DraftConfig:
    kind = raw["speculators_model_type"]
    if kind != "dspark":
        raise CheckpointError(f"{path}: speculators_model_type {kind!r}: expected 'dspark'")
    backbone_key = next((k for k in ("transformer_layer_config", "transformer_config") if k in raw), None)
    if backbone_key is None:
        raise CheckpointError(f"{path}: must provide transformer_layer_config or transformer_config")
    if not isinstance(raw[backbone_key], dict):
        raise CheckpointError(f"{path}: '{backbone_key}' must be a dictionary")
    decoder, vocab, positions, _ = DRAFTS[QWEN3_DRAFT].read(raw[backbone_key], path, f"{backbone_key}.")
    try:
        method = raw["speculators_config"]["proposal_methods"][0]
    except (KeyError, IndexError, TypeError):
        method = None
    if not isinstance(method, dict):
        raise CheckpointError(f"{path}: invalid speculators config structure: expected an object "
                              f"at speculators_config.proposal_methods[0]")
    default_k = _int_field(method, "speculative_tokens", path,
                           "speculators_config.proposal_methods[0]: drafts per step", 1)
    taps = _require(raw, "aux_hidden_state_layer_ids", path, "vLLM capture layer ids")
    config = DraftConfig(
        architecture=QWEN3_DRAFT,
        source_format="speculators",
        decoder=decoder,
        vocab_size=vocab,
        draft_vocab_size=_optional_int(raw, "draft_vocab_size", path, "draft vocabulary", vocab),
        target_layer_ids=_taps(taps, path, "aux_hidden_state_layer_ids", shift=-1),
        target_hidden_size=_optional_int(raw, "target_hidden_size", path, "the target's hidden size",
                                         target_hidden_size),
        block_size=_int_field(raw, "block_size", path, BLOCK_SIZE, 2, maximum=positions, default=8),
        layout=ANCHOR_FIRST if _bool_field(raw, "sample_from_anchor", path, True) else BONUS_ANCHOR,
        mask_token_id=_int_field(raw, "mask_token_id", path, "MASK token of the block", 0),
        markov_rank=_markov(raw, path, rank_default=256),
        default_k=default_k,
        logit_scale=_logit_scale(raw[backbone_key], path, f"{backbone_key}."),
    )
    _check_taps(config.target_layer_ids, path, target_num_layers, "aux_hidden_state_layer_ids", shift=1)
    return config


def _taps(ids, path: Path, field: str, shift: int) -> tuple[int, ...]:
    """Ascending DeepSpec-convention tap ids (concatenation order is ascending layer order)."""
    if not isinstance(ids, list) or not ids or not all(is_int(i) for i in ids):
        raise CheckpointError(f"{path}: field '{field}' = {ids!r}: expected a non-empty list of ints")
    if len(set(ids)) != len(ids):
        raise CheckpointError(f"{path}: field '{field}' = {ids}: repeats a layer")
    if shift == 0 and ids != sorted(ids):
        # DeepSpec concatenates taps in list order and asserts it is increasing; a permuted list
        # would feed fc's column blocks in the wrong order
        raise CheckpointError(f"{path}: field '{field}' = {ids}: expected strictly increasing ids")
    return tuple(sorted(i + shift for i in ids))


def _check_taps(taps: tuple[int, ...], path: Path, target_num_layers: int, field: str, shift: int) -> None:
    """Every tap (DeepSpec convention) names a layer of the target, ``field`` in its own
    convention (``shift``: what it adds to a DeepSpec id)."""
    last = target_num_layers - 2  # the final layer's output is only seen normed in HF; DeepSpec refuses it
    for tap in taps:
        if not -1 <= tap <= last:
            raise CheckpointError(
                f"{path}: field '{field}' names layer {tap + shift}, outside the target's "
                f"{target_num_layers} layers (allowed {-1 + shift}..{last + shift} in this field's "
                f"convention; the final layer cannot be tapped)")


def _check_capture_ids(ids, taps: tuple[int, ...], path: Path, taps_field: str) -> None:
    """A native config that also names vLLM's capture ids must name the layers its taps do: vLLM
    captures the input of layer ``t + 1`` for tap ``t``."""
    expected = [tap + 1 for tap in taps]
    if ids != expected:
        raise CheckpointError(f"{path}: field 'eagle_aux_hidden_state_layer_ids' = {ids!r}: expected "
                              f"{expected}, the capture ids of {taps_field} {list(taps)} (each plus one)")
