"""The target LLM's configuration, read through ``transformers.AutoConfig``."""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, replace
from pathlib import Path

from .checkpoint import CheckpointError, hf_location, one_line, read_config, read_json
from .decoder import CONFIG_ERRORS, DecoderConfig, check_fields, is_int
from .gemma4_model import SLIDING, Gemma4Layout, layout_from_hf
from .moe import MOE_FIELDS, MoeConfig
from .qwen3_5_model import FULL, LINEAR, LinearAttentionConfig

# architecture -> whether its attention normalises q and k per head
SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM": True, "LlamaForCausalLM": False, "Qwen3MoeForCausalLM": True,
                           "Qwen3_5ForCausalLM": True, "Qwen3_5ForConditionalGeneration": True,
                           "Qwen3_5MoeForCausalLM": True, "Qwen3_5MoeForConditionalGeneration": True,
                           "Gemma4ForCausalLM": True, "Gemma4ForConditionalGeneration": True,
                           "Gemma4UnifiedForCausalLM": True, "Gemma4UnifiedForConditionalGeneration": True}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",   # by model_type
                 "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
                 "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                 "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
                 "gemma4_text": "Gemma4ForCausalLM", "gemma4": "Gemma4ForConditionalGeneration",
                 "gemma4_unified_text": "Gemma4UnifiedForCausalLM",
                 "gemma4_unified": "Gemma4UnifiedForConditionalGeneration"}
HYBRID = {"Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
          "Qwen3_5MoeForConditionalGeneration"}
MOE = {"Qwen3MoeForCausalLM": False, "Qwen3_5MoeForCausalLM": True,   # -> whether it has a shared expert
       "Qwen3_5MoeForConditionalGeneration": True}
# a multimodal checkpoint keeps its text model's config under this key, its weights under the prefix
MULTIMODAL = dict.fromkeys(("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                            "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration"),
                           "text_config")
# Gemma 4, and its "unified" form (the 12B: the same text layers without per-layer inputs or MoE)
GEMMA4 = {"Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "Gemma4UnifiedForCausalLM",
          "Gemma4UnifiedForConditionalGeneration"}
# the hybrid's shape fields beyond the dense decoder's
LINEAR_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads")
# Gemma 4's full layers' shapes (transformers takes them as arguments, or per_layer_config)
GEMMA4_FIELDS = ("global_head_dim", "num_global_key_value_heads")


@dataclass(frozen=True)
class TargetConfig:
    architecture: str
    decoder: DecoderConfig
    vocab_size: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    linear: LinearAttentionConfig | None = None   # a hybrid's linear-attention layers
    moe: MoeConfig | None = None                    # a MoE target's sparse blocks
    gemma4: Gemma4Layout | None = None              # a Gemma 4 target's layers beyond decoder's


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=4)
def _gguf_config(path: Path, stamp: tuple[int, int]):
    """A GGUF file's config as ``transformers`` reads it, once per process and version of the file
    (it parses the file's metadata: seconds, and a build asks four times); each caller gets a copy."""
    from transformers import AutoConfig

    location, options = hf_location(path)
    return AutoConfig.from_pretrained(location, **options)


def load_target_config(directory: Path) -> TargetConfig:
    """``directory`` is a checkpoint directory or a ``.gguf`` file."""
    from transformers import AutoConfig

    gguf = directory.suffix == ".gguf"
    path = directory if gguf else directory / "config.json"
    if not gguf:
        raw = read_config(directory)
        architectures = raw.get("architectures")
        if architectures is None:  # transformers then picks the model by model_type alone
            by_type = ARCHITECTURES.get(str(raw.get("model_type")))
            architectures = [by_type] if by_type else []
        _check_raw(raw, _supported(architectures, path), path)
    try:
        hf = (copy.deepcopy(_gguf_config(directory, _stamp(directory))) if gguf
              else AutoConfig.from_pretrained(directory))
    except ImportError as err:
        raise CheckpointError(f"{path}: reading a GGUF target needs the gguf extra "
                              f"(pip install -e '.[gguf]'): {err}") from None
    except (*CONFIG_ERRORS, OSError) as err:
        raise CheckpointError(f"{path}: transformers cannot read it ({one_line(err)})") from None
    if gguf:
        architectures = hf.architectures or [ARCHITECTURES.get(hf.model_type, hf.model_type)]
    arch = _supported(architectures, path)
    hf = hf.get_text_config() if arch in MULTIMODAL else hf
    nested = f"{MULTIMODAL[arch]}: " if arch in MULTIMODAL else ""
    layer_types = list(getattr(hf, "layer_types", None) or [])
    allowed = (FULL, LINEAR) if arch in HYBRID else (FULL, SLIDING) if arch in GEMMA4 else (FULL,)
    if any(t not in allowed for t in layer_types):
        kinds = "full or linear attention" if arch in HYBRID else "only full attention"
        raise CheckpointError(f"{path}: layer_types {layer_types}: {kinds} is supported "
                              f"(no sliding-window layers)")
    gemma4 = None
    try:
        if arch in GEMMA4:
            decoder, gemma4 = layout_from_hf(hf)
        else:
            decoder = DecoderConfig.from_hf(hf, qk_norm=SUPPORTED_ARCHITECTURES[arch],
                                            partial_rotary=arch in HYBRID)
    except CONFIG_ERRORS as err:
        raise CheckpointError(f"{path}: {nested}{one_line(err)}") from None
    linear = LinearAttentionConfig.from_hf(hf) if arch in HYBRID else None
    if linear is not None:   # Qwen3.5's MLP has no biases whatever mlp_bias says (transformers ignores it)
        decoder = replace(decoder, mlp_bias=False)
    try:
        moe = MoeConfig.from_hf(hf, shared_expert=MOE[arch]) if arch in MOE else None
    except CONFIG_ERRORS as err:
        raise CheckpointError(f"{path}: {one_line(err)}") from None
    if linear is not None and len(linear.layer_types) != decoder.num_layers:
        raise CheckpointError(f"{path}: field 'layer_types' has {len(linear.layer_types)} entries: "
                              f"expected one per layer ({decoder.num_layers}, num_hidden_layers)")
    return TargetConfig(
        linear=linear, moe=moe, gemma4=gemma4,
        architecture=arch,
        decoder=decoder,
        vocab_size=hf.vocab_size,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        eos_token_ids=_eos_token_ids(None if gguf else directory, hf, path),
        max_position_embeddings=hf.max_position_embeddings,
    )


def _supported(architectures, path: Path) -> str:
    listed = architectures if isinstance(architectures, list) else []
    arch = next((a for a in listed if isinstance(a, str) and a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(f"{path}: architectures {architectures} is not a supported target; "
                              f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _check_raw(raw: dict, arch: str, path: Path) -> None:
    """What transformers would read differently from the checkpoint: a model_type of another
    architecture (transformers builds the config by model_type) or a missing or malformed shape
    field (``decoder.check_fields``)."""
    model_type = next(m for m, a in ARCHITECTURES.items() if a == arch)
    if raw.get("model_type") != model_type:
        raise CheckpointError(f"{path}: field 'model_type' = {raw.get('model_type')!r}: expected "
                              f"{model_type!r} for {arch}")
    where = ""
    if arch in MULTIMODAL:
        key = MULTIMODAL[arch]
        if not isinstance(raw.get(key), dict):
            raise CheckpointError(f"{path}: field '{key}' = {raw.get(key)!r}: expected the text "
                                  f"model's config (an object)")
        raw, where, model_type = raw[key], f"{key}.", f"{model_type}_text"
        if raw.get("model_type", model_type) != model_type:
            raise CheckpointError(f"{path}: field '{where}model_type' = {raw.get('model_type')!r}: "
                                  f"expected {model_type!r} for {arch}")
    extra = (LINEAR_FIELDS if arch in HYBRID else ()) + (MOE_FIELDS if arch in MOE else ()) + \
        (("shared_expert_intermediate_size",) if MOE.get(arch) else ()) + \
        (GEMMA4_FIELDS if arch in GEMMA4 else ())
    try:
        check_fields(raw, model_type, extra)
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
