"""A target checkpoint's configuration (directory or GGUF file) as a ``TargetConfig``, read through
``transformers.AutoConfig`` and checked against its family's registry entry."""
from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path

from modeling.checkpoint import (
    CheckpointError,
    file_stamp,
    gguf_reader,
    hf_location,
    one_line,
    read_config,
    read_json,
)
from modeling.decoder import CONFIG_ERRORS, check_fields, is_int
from modeling.registry import ARCHITECTURES, Architecture, by_model_type
from modeling.target_config import TargetConfig


def gguf_config(path: Path):
    """A GGUF file's ``transformers`` config, as ``_read_gguf_config`` reads it; a copy."""
    return copy.deepcopy(_read_gguf_config(path, file_stamp(path)))


@functools.lru_cache(maxsize=4)
def _read_gguf_config(path: Path, stamp: tuple[int, int]):
    """A GGUF file's config as ``transformers`` reads it, once per process and version of the file
    (it parses the file's metadata: seconds, and a build asks four times); each caller gets a copy.
    ``transformers`` 5.x drops ``expert_feed_forward_length``, leaving a MoE file's expert width at
    its config class's default (Qwen3-30B-A3B's 768): it is read here, as llama.cpp reads it."""
    from transformers import AutoConfig

    location, options = hf_location(path)
    config = AutoConfig.from_pretrained(location, **options)
    fields = gguf_reader(path).fields
    architecture = fields["general.architecture"].contents()
    if (width := fields.get(f"{architecture}.expert_feed_forward_length")) is not None:
        config.moe_intermediate_size = int(width.contents())
    return config


def load_target_config(directory: Path) -> TargetConfig:
    """``directory`` is a checkpoint directory or a ``.gguf`` file."""
    from transformers import AutoConfig

    gguf = directory.suffix == ".gguf"
    path = directory if gguf else directory / "config.json"
    if not gguf:
        raw = read_config(directory)
        architectures = raw.get("architectures")
        if architectures is None:  # transformers then picks the model by model_type alone
            by_type = by_model_type(str(raw.get("model_type")))
            architectures = [by_type.name] if by_type else []
        _check_raw(raw, _supported(architectures, path), path)
    try:
        hf = gguf_config(directory) if gguf else AutoConfig.from_pretrained(directory)
    except ImportError as err:
        raise CheckpointError(f"{path}: reading a GGUF target needs the gguf extra "
                              f"(pip install -e '.[gguf]'): {err}") from None
    except (*CONFIG_ERRORS, OSError) as err:
        raise CheckpointError(f"{path}: transformers cannot read it ({one_line(err)})") from None
    if gguf:
        by_type = by_model_type(hf.model_type)
        architectures = hf.architectures or [by_type.name if by_type else hf.model_type]
    arch = _supported(architectures, path)
    family = arch.family
    hf = hf.get_text_config() if arch.text_config else hf
    nested = f"{arch.text_config}: " if arch.text_config else ""
    layer_types = list(getattr(hf, "layer_types", None) or [])
    if any(t not in family.layer_kinds for t in layer_types):
        raise CheckpointError(f"{path}: {nested}layer_types {layer_types}: expected each of "
                              f"{', '.join(family.layer_kinds)} ({arch.name})")
    try:
        parts = family.read(hf)
    except CONFIG_ERRORS as err:
        raise CheckpointError(f"{path}: {nested}{one_line(err)}") from None
    return TargetConfig(
        architecture=arch.name,
        vocab_size=hf.vocab_size,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        eos_token_ids=_eos_token_ids(None if gguf else directory, hf, path),
        max_position_embeddings=hf.max_position_embeddings,
        # the decoder and the family's config parts, as its reader made them
        **{field.name: getattr(parts, field.name) for field in dataclasses.fields(parts)},
    )


def _supported(architectures, path: Path) -> Architecture:
    listed = architectures if isinstance(architectures, list) else []
    arch = next((a for a in listed if isinstance(a, str) and a in ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(f"{path}: architectures {architectures} is not a supported target; "
                              f"expected one of {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[arch]


def _check_raw(raw: dict, arch: Architecture, path: Path) -> None:
    """What transformers would read differently from the checkpoint: a model_type of another
    architecture (transformers builds the config by model_type) or a missing or malformed shape
    field (``decoder.check_fields``)."""
    if raw.get("model_type") != arch.model_type:
        raise CheckpointError(f"{path}: field 'model_type' = {raw.get('model_type')!r}: expected "
                              f"{arch.model_type!r} for {arch.name}")
    where, model_type = "", arch.model_type
    if arch.text_config:
        key = arch.text_config
        if not isinstance(raw.get(key), dict):
            raise CheckpointError(f"{path}: field '{key}' = {raw.get(key)!r}: expected the text "
                                  f"model's config (an object)")
        raw, where, model_type = raw[key], f"{key}.", arch.family.model_type
        if raw.get("model_type", model_type) != model_type:
            raise CheckpointError(f"{path}: field '{where}model_type' = {raw.get('model_type')!r}: "
                                  f"expected {model_type!r} for {arch.name}")
    try:
        check_fields(raw, model_type, arch.family.fields)
    except ValueError as err:
        raise CheckpointError(f"{path}: {where}{err}") from None


def _eos_token_ids(directory: Path | None, hf, path: Path) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` when present (chat models often list several),
    else from the config; each must be a token of the vocabulary."""
    eos = getattr(hf, "eos_token_id", None)
    generation = directory / "generation_config.json" if directory else None
    if generation is not None and generation.is_file():
        eos, path = read_json(generation).get("eos_token_id", eos), generation
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(is_int(i) and 0 <= i < hf.vocab_size for i in ids):
        raise CheckpointError(f"{path}: field 'eos_token_id' = {eos!r}: expected a token id or a list "
                              f"of them, each from 0 to {hf.vocab_size - 1}")
    return tuple(ids)
