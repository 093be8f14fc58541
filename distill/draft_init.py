"""The fresh draft: which target layers it taps, its native ``config.json`` (the target's, through
``modeling.draft_config.native_config``) and its starting weights."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig

from modeling.checkpoint import hf_location, read_config
from modeling.dense import TargetStep
from modeling.draft import DraftStep
from modeling.draft_config import load_draft_config, native_config
from modeling.registry import ARCHITECTURES, QWEN3_DRAFT
from modeling.target_config_reader import load_target_config

from .options import DistillSpec


def default_taps(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """``count`` layers spread from layer 1 to layer ``N - 3``, as in the released drafts
    (``[1, 9, 17, 25, 33]`` of 36); small targets fall back to every layer but the final one,
    which DeepSpec never taps."""
    for low, high in ((1, num_layers - 3), (0, num_layers - 2), (-1, num_layers - 2)):
        if high - low + 1 >= count:
            step = (high - low) / (count - 1) if count > 1 else 0
            return tuple(int(low + i * step + 0.5) for i in range(count))
    return tuple(range(-1, num_layers - 1))


def check_taps(taps: tuple[int, ...], num_layers: int) -> None:
    outside = [t for t in taps if not -1 <= t <= num_layers - 2]
    if outside:
        raise ValueError(f"--taps {','.join(map(str, taps))}: layer {outside[0]} is outside "
                         f"-1..{num_layers - 2} (DeepSpec convention, -1 = the embedding output; the "
                         f"target has {num_layers} layers and its final one cannot be tapped)")


def init_layers(spec: DistillSpec, num_layers: int) -> list[int]:
    """The target layers the draft's decoder layers start from, in order: the ``--layers``
    consecutive ones ending at ``--init-layer`` (none for random weights)."""
    if spec.init_layer is None:
        return []
    first = spec.layers - 1          # the lowest layer with --layers layers up to it
    if not first - num_layers <= spec.init_layer < num_layers or 0 <= spec.init_layer < first:
        raise ValueError(f"--init-layer {spec.init_layer}: expected {first}..{num_layers - 1} or "
                         f"{first - num_layers}..-1 (counted from the last of the target's "
                         f"{num_layers} layers) for a {spec.layers}-layer draft, or 'random'")
    last = spec.init_layer % num_layers
    return list(range(last - spec.layers + 1, last + 1))


def num_target_layers(target_dir: Path) -> int:
    """The target's layer count; a target whose family's draft is not DeepSpec's
    ``Qwen3DSparkModel`` (the registry's ``Family.draft``: Gemma 4's) is refused, since ``distill``
    trains Qwen3 backbones only."""
    config = load_target_config(target_dir)
    draft = ARCHITECTURES[config.architecture].family.draft
    if draft != QWEN3_DRAFT:
        raise ValueError(f"{target_dir}: a {config.architecture} target's draft is a {draft}, "
                         f"which distill does not train yet; train it with DeepSpec and load it with "
                         f"`python -m export build`")
    return config.decoder.num_layers


def draft_config(target_dir: Path, target: TargetStep, spec: DistillSpec, taps: tuple[int, ...],
                 mask: int, kept: torch.Tensor | None) -> dict:
    """The draft's native config: the target's, with the backbone shape as the target loaded
    (a GGUF target's config dict may lack it) and the draft's fields set."""
    d = target.config.decoder
    shape = dict(num_hidden_layers=d.num_layers, hidden_size=d.hidden_size,
                 intermediate_size=d.intermediate_size, num_attention_heads=d.num_heads,
                 num_key_value_heads=d.num_kv_heads, head_dim=d.head_dim, rms_norm_eps=d.rms_norm_eps,
                 vocab_size=target.config.vocab_size)
    return native_config(_target_config_dict(target_dir) | shape, layers=spec.layers,
                         block_size=spec.block_size, taps=taps, mask_token_id=mask,
                         markov_rank=spec.markov_rank, num_anchors=spec.batch_anchors,
                         draft_vocab_size=None if kept is None else len(kept))


def _target_config_dict(target_dir: Path) -> dict:
    """The target's config as a dict, which a native draft config is a copy of
    (``docs/dspark.md#checkpoint-and-config-conventions``)."""
    if target_dir.is_dir():
        return read_config(target_dir)
    location, options = hf_location(target_dir)
    # only what differs from PretrainedConfig's defaults, as a config.json on the hub would hold
    return AutoConfig.from_pretrained(location, **options).to_diff_dict()


def new_draft(out: Path, target: TargetStep, config: dict, kept: torch.Tensor | None,
              sources: list[int]) -> DraftStep:
    """Write ``config.json`` and build its ``DraftStep``, read back through the loader's own config
    parser so that what is trained is what loads. ``embed_tokens`` / ``lm_head`` are the target's
    (the kept rows for a reduced vocabulary) and frozen; the Markov head starts at zero bias.

    The decoder layers start from the target's layers ``sources`` (what both models have; a Qwen3
    draft's q/k norms stay at one over a Llama target): on a CPU's worth of data that generalises
    better than random weights (held-out tau 2.03 against 1.96 for the SmolLM2 demo pair)."""
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    decoder = target.config.decoder
    parsed = load_draft_config(out, decoder.num_layers, decoder.hidden_size)
    draft = DraftStep(parsed, target.config.vocab_size, parsed.max_drafts)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.embed_tokens.weight)
        lm_head = target.lm_head.weight
        draft.lm_head.weight.copy_(lm_head if kept is None else lm_head[kept])
        if kept is not None:
            draft.d2t.copy_(kept - torch.arange(len(kept)))
        draft.markov_head.markov_w2.weight.zero_()
        for layer, source in zip(draft.layers, sources):
            layer.load_state_dict(target.layers[source].state_dict(), strict=False)
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    return draft
