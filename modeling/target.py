"""``load_target``: a target checkpoint (directory or GGUF file) as its family's step module
(``registry.py``; the dense one is ``dense.TargetStep``, whose contract every step keeps),
and ``from_start``, a teacher-forced pass over fresh caches."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path

import torch

from modeling.checkpoint import (
    CheckpointError,
    build_module,
    check_layer_count,
    gguf_reader,
    hf_location,
    load_tensors,
    read_tensor,
    resolve,
    stored_shape,
    stored_tensors,
)
from modeling.decoder import CachedStep
from modeling.dense import TargetStep
from modeling.lazy_weights import DeferredWeights, GgufWeights, hold_placeholders
from modeling.moe import fuse_experts
from modeling.registry import ARCHITECTURES
from modeling.target_config import TargetConfig
from modeling.target_config_reader import gguf_config, load_target_config

# a multimodal checkpoint's towers and MTP layer, which the text model ignores
IGNORED = ("model.visual.", "mtp.", "model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
           "model.embed_audio.", "model.vision_embedder.", "model.audio_embedder.")


def load_target(path: str | Path, taps: Sequence[int] = (), dtype: torch.dtype = torch.float32,
                role: str = "target") -> CachedStep:
    """The family's step module (``registry.py``), which keeps ``dense.TargetStep``'s contract."""
    return _load(path, taps, dtype, role, lazy=False)[0]


def load_target_lazily(path: str | Path, taps: Sequence[int] = (),
                       dtype: torch.dtype = torch.float32) -> tuple[CachedStep, GgufWeights | None]:
    """``load_target``, but a GGUF target whose weights ``GgufWeights`` reads one at a time is
    built holding ``lazy_weights.placeholder``s, its weights left in the file (``lazy_weights``:
    what lets a build hold one layer de-quantized, not the model); None where it loaded whole."""
    return _load(path, taps, dtype, "target", lazy=True)


def _load(path: str | Path, taps: Sequence[int], dtype: torch.dtype, role: str,
          lazy: bool) -> tuple[CachedStep, GgufWeights | None]:
    directory = resolve(path, role)
    config = load_target_config(directory)
    arch = ARCHITECTURES[config.architecture]
    family = arch.family
    weights = None
    moe = config.moe is not None
    if lazy and directory.suffix == ".gguf" and GgufWeights.supports(directory, family.step, moe):
        weights = GgufWeights(directory, gguf_config(directory))
    tensors = _tensors(directory, config, shapes=None if weights is None else weights.shapes)
    config_file = directory if directory.suffix == ".gguf" else directory / "config.json"
    nested = f"{arch.text_config}." if arch.text_config else ""
    fields = f"{config_file}: field '{nested}"
    check_layer_count(tensors, config.decoder.num_layers, f"{fields}num_hidden_layers'")
    if moe:
        fuse_experts(tensors, config.moe)
    if family.check_weights is not None:
        family.check_weights(tensors, config, fields)
    target = build_module(lambda: family.step(config, taps), tensors, directory, dtype)
    if family.check_unused is not None:   # build_module took what the module holds: the rest is unused
        family.check_unused(tensors, config, directory)
    if weights is not None:
        tied = "lm_head.weight" not in weights.shapes
        hold_placeholders(target)
    else:
        tied = torch.equal(target.lm_head.weight, target.embed_tokens.weight)
    if tied:
        # tied (lm_head.weight absent, or stored with the same values): one parameter, so that
        # torch.export lifts one tensor and the ONNX graph holds the embedding once (two parameters
        # over the same storage still become two initializers)
        target.lm_head.weight = target.embed_tokens.weight
    return target, weights


SHARED = frozenset({"embed_tokens.weight", "lm_head.weight"})   # what a draft may take from its target


def load_embeddings(path: str | Path) -> dict[str, torch.Tensor]:
    """The target's ``embed_tokens.weight`` and ``lm_head.weight`` (the same tensor when tied),
    read without the rest of its weights: what a draft that shares them needs."""
    directory = resolve(path, "target")
    tensors = _tensors(directory, load_target_config(directory), only=SHARED)
    missing = SHARED - tensors.keys()
    if missing:
        raise CheckpointError(f"{directory}: missing tensor {', '.join(sorted(missing))}")
    return tensors


def embeddings_read_lazily(path: str | Path) -> tuple[dict[str, torch.Tensor], DeferredWeights]:
    """``load_embeddings``' tensors as meta tensors of their shapes (a tied ``lm_head.weight`` the
    embedding's), and the weights that read each from the checkpoint when asked."""
    directory = resolve(path, "target")
    config = load_target_config(directory)
    if directory.suffix == ".gguf":
        stored = _gguf_shared(directory)
        readers = {name: partial(_dequantized, t) for name, t in stored.items()}
        shapes = {name: list(reversed(t.shape.tolist())) for name, t in stored.items()}   # fastest axis first
    else:
        where = stored_tensors(directory, strip_prefix=_prefix(config), only=SHARED, skip=IGNORED)
        readers = {name: partial(read_tensor, *place) for name, place in where.items()}
        shapes = {name: stored_shape(*place) for name, place in where.items()}
    tensors = _tensors(directory, config, only=SHARED, shapes=shapes)
    missing = SHARED - tensors.keys()
    if missing:
        raise CheckpointError(f"{directory}: missing tensor {', '.join(sorted(missing))}")
    readers.setdefault("lm_head.weight", readers["embed_tokens.weight"])   # tied
    return tensors, DeferredWeights(readers)


def _tensors(directory: Path, config: TargetConfig, only: frozenset[str] | None = None,
             shapes: Mapping[str, Sequence[int]] | None = None):
    """The checkpoint's tensors under the module's names (``model.`` prefix stripped, a tied
    ``lm_head.weight`` filled in from the embedding, no RoPE tables); with ``shapes`` (the
    tensors' by those names), tensors of those shapes on the meta device, which hold nothing."""
    if shapes is not None:
        tensors = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    elif directory.suffix == ".gguf":
        tensors = _gguf_embeddings(directory) if only == SHARED else _gguf_tensors(directory)
    else:
        # the embedding is read with whatever is asked for: a tied lm_head.weight is made from it
        wanted = None if only is None else only | {"embed_tokens.weight"}
        prefix = _prefix(config)
        tensors = load_tensors(directory, strip_prefix=prefix, only=wanted, skip=IGNORED)
        if prefix != "model." and not any(name.startswith("layers.") or name == "embed_tokens.weight"
                                          for name in tensors):
            raise CheckpointError(f"{directory}: no text weights ({prefix}*) although config.json's "
                                  f"architectures names {config.architecture}")
    if "lm_head.weight" not in tensors:
        if not config.tie_word_embeddings:
            raise CheckpointError(f"{directory}: missing tensor lm_head.weight "
                                  f"(config.json: tie_word_embeddings is false)")
        tensors["lm_head.weight"] = tensors.get("embed_tokens.weight")
    return {k: v for k, v in tensors.items() if v is not None and not k.endswith("rotary_emb.inv_freq")
            and (only is None or k in only)}


def from_start(target: TargetStep, input_ids: torch.Tensor,
               logit_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, aux)`` of ``target`` on ``input_ids [B, S]`` from position 0 over fresh caches
    (a hybrid's state in one slot): a teacher-forced pass, the caches discarded."""
    batch, rows = input_ids.shape
    start = torch.zeros(batch, dtype=torch.long, device=input_ids.device)
    states = (start, torch.full_like(start, rows - 1)[:, None]) if target.takes_states else ()
    logits, aux, *_ = target(input_ids, start, logit_rows, *states, *target.empty_cache(batch, rows))
    return logits, aux


def every_row(input_ids: torch.Tensor) -> torch.Tensor:
    """``logit_rows`` that ask for the logits of every row of ``input_ids [B, S]``."""
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)


# llama.cpp's names of the tensors a draft may share (``SHARED``), the same in every architecture
GGUF_SHARED = {"token_embd.weight": "embed_tokens.weight", "output.weight": "lm_head.weight"}


def _gguf_embeddings(path: Path) -> dict[str, torch.Tensor]:
    """A GGUF target's ``SHARED`` tensors alone, de-quantized as ``transformers`` de-quantizes
    them (with ``gguf``'s own code; no other tensor is read): a fifth of the time of all of them."""
    return {name: _dequantized(tensor) for name, tensor in _gguf_shared(path).items()}


def _gguf_shared(path: Path) -> dict:
    """The GGUF file's ``SHARED`` tensors (``gguf``'s, not read yet) under the module's names."""
    return {GGUF_SHARED[t.name]: t for t in gguf_reader(path).tensors if t.name in GGUF_SHARED}


def _dequantized(tensor) -> torch.Tensor:
    """A GGUF file's tensor de-quantized to float32 (``gguf``'s code, which ``transformers``
    uses): a new array, not the file's map."""
    import numpy as np
    from gguf.quants import dequantize

    return torch.from_numpy(np.copy(dequantize(tensor.data, tensor.tensor_type))).float()


def _prefix(config: TargetConfig) -> str:
    """The prefix of the text model's tensors in a checkpoint folder (``model.``, or the
    multimodal classes')."""
    return ARCHITECTURES[config.architecture].weight_prefix


def _gguf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A GGUF target's weights, de-quantized to fp32 by ``transformers``, in the model our reading
    of its config describes (``target_config_reader.gguf_config``)."""
    from transformers import AutoModelForCausalLM

    location, options = hf_location(path)
    model = AutoModelForCausalLM.from_pretrained(location, config=gguf_config(path), dtype=torch.float32,
                                                 **options)
    return {name.removeprefix("model."): tensor for name, tensor in model.state_dict().items()}
