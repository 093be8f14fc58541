"""The target LLM's configuration, read through ``transformers.AutoConfig``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import CheckpointError, read_config
from .decoder import DecoderConfig

# architecture -> whether its attention normalises q and k per head
SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM": True, "LlamaForCausalLM": False}


@dataclass(frozen=True)
class TargetConfig:
    architecture: str
    decoder: DecoderConfig
    vocab_size: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int


def load_target_config(directory: Path) -> TargetConfig:
    raw = read_config(directory)
    path = directory / "config.json"
    architectures = raw.get("architectures") or []
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(f"{path}: architectures {architectures} is not a supported target; "
                              f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(directory)
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: transformers cannot read it ({err})") from None
    if any(t != "full_attention" for t in (getattr(hf, "layer_types", None) or [])):
        raise CheckpointError(f"{path}: layer_types {hf.layer_types}: only full attention is "
                              f"supported (no sliding-window layers)")
    try:
        decoder = DecoderConfig.from_hf(hf, qk_norm=SUPPORTED_ARCHITECTURES[arch])
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from None
    return TargetConfig(
        architecture=arch,
        decoder=decoder,
        vocab_size=hf.vocab_size,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        eos_token_ids=_eos_token_ids(directory, hf),
        max_position_embeddings=hf.max_position_embeddings,
    )


def _eos_token_ids(directory: Path, hf) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` when present (chat models often list several),
    else from ``config.json``."""
    eos = getattr(hf, "eos_token_id", None)
    generation = directory / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
