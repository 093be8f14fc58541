"""The target LLM's configuration, read through ``transformers.AutoConfig``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import CheckpointError, hf_location, read_config
from .decoder import DecoderConfig

# architecture -> whether its attention normalises q and k per head
SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM": True, "LlamaForCausalLM": False}
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}  # by model_type


@dataclass(frozen=True)
class TargetConfig:
    architecture: str
    decoder: DecoderConfig
    vocab_size: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int


def load_target_config(directory: Path) -> TargetConfig:
    """``directory`` is a checkpoint directory or a ``.gguf`` file."""
    from transformers import AutoConfig

    gguf = directory.suffix == ".gguf"
    path = directory if gguf else directory / "config.json"
    if not gguf:
        architectures = read_config(directory).get("architectures") or []
        _supported(architectures, path)
    try:
        location, options = hf_location(directory)
        hf = AutoConfig.from_pretrained(location, **options)
    except ImportError as err:
        raise CheckpointError(f"{path}: reading a GGUF target needs the gguf extra "
                              f"(pip install -e '.[gguf]'): {err}") from None
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise CheckpointError(f"{path}: transformers cannot read it ({err})") from None
    if gguf:
        architectures = hf.architectures or [GGUF_ARCHITECTURES.get(hf.model_type, hf.model_type)]
    arch = _supported(architectures, path)
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
        eos_token_ids=_eos_token_ids(None if gguf else directory, hf),
        max_position_embeddings=hf.max_position_embeddings,
    )


def _supported(architectures: list, path: Path) -> str:
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(f"{path}: architectures {architectures} is not a supported target; "
                              f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _eos_token_ids(directory: Path | None, hf) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` when present (chat models often list several),
    else from the config."""
    eos = getattr(hf, "eos_token_id", None)
    generation = directory / "generation_config.json" if directory else None
    if generation is not None and generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
