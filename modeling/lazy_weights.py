"""A model's weights left in their files until a computation needs them.

``transformers`` loads a GGUF target whole, de-quantized to float32: 8x a Q4 file's bytes, so an
8B file (32 GB in float32) cannot build on a 24 GB machine; the ``qwen3-8b`` preset's draft is 4.7 GB
of bf16, 9.5 GB in float32. A build needs the values three times (the graph's initializers, the verify
inputs' context, the reference outputs) and never all at once, so the module holds
``placeholder``s (zero-stride views of one zero: no memory, and ``torch.export`` traces them as the
weights they stand for), the traced graph's initializers read the files one tensor at a time as
they are written (``export.onnx_export.export_graph``), and ``resident(module, weights)`` gives
the module its real weights while it computes: a decoder layer's (or a linear layer's) while it
runs, the rest for the whole call.

A GGUF target's tensors (``GgufWeights``) are each de-quantized as ``transformers`` de-quantizes
them (``gguf``'s ``dequantize``, then its tensor processor: Llama's q / k rows back in the rotary
layout), under the names its model gives them, so the module computes what ``transformers``' own
load would give it (``tests/graphs/test_gguf.py``). Families whose processor does more than rename
and permute (MoE expert stacks, Gemma's norms) load whole, as before (``supports``). A draft's
(``DeferredWeights``: ``modeling.draft.load_draft_lazily``) are read from its checkpoint and the
target's (shared embeddings), each through what its loader does to them (a vocabulary cut to the
target's, a logit scale) and what its build does (``export.quantize.rounded_as_read``).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from modeling.checkpoint import gguf_reader

PREFIX = "model."   # transformers' names of the text model's tensors, which the step modules drop


def placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` that holds one zero: what a lazy module's weights are
    between computations."""
    return torch.zeros((), dtype=dtype).expand(shape)


def hold_placeholders(module: torch.nn.Module) -> None:
    """Give each of ``module``'s parameters (on the meta device, say) a ``placeholder`` of its
    shape and dtype in place of its values."""
    for owner in module.modules():
        for name, parameter in owner.named_parameters(recurse=False):
            setattr(owner, name, torch.nn.Parameter(placeholder(parameter.shape, parameter.dtype),
                                                    requires_grad=False))


class LazyWeights(Protocol):
    """A module's weights by its parameters' names, each read from its files when asked (a new
    tensor each time, the caller's to keep or let go)."""

    def load(self, name: str) -> torch.Tensor: ...


class DeferredWeights:
    """Weights by name, each read by its own function when asked (``readers``: a safetensors
    file's tensor, a GGUF file's, ...), then through ``prepare(name, tensor)``: what a loader or a
    build does to a module's weights, done to each as it is needed."""

    def __init__(self, readers: Mapping[str, Callable[[], torch.Tensor]],
                 prepare: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, tensor: tensor):
        self.readers, self.prepare = dict(readers), prepare

    def load(self, name: str) -> torch.Tensor:
        return self.prepare(name, self.readers[name]())

    def then(self, prepare: Callable[[str, torch.Tensor], torch.Tensor]) -> DeferredWeights:
        """These weights, each then through ``prepare`` too."""
        return DeferredWeights(self.readers, lambda name, tensor: prepare(name, self.prepare(name, tensor)))


class GgufWeights:
    """A GGUF target's float weights by the step module's names (``model.`` dropped), each read
    and de-quantized from the file when asked. ``shapes`` is what the file holds; the tied output
    layer (no ``output.weight``) is the embeddings' name alone."""

    def __init__(self, path: Path, hf_config):
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
        from transformers import AutoModelForCausalLM

        reader = gguf_reader(path)
        architecture = _architecture(path)
        self.processor = _processor(architecture)(config=hf_config.to_dict())
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        # transformers' get_gguf_hf_weights_map, once: it makes gguf's name map again for each
        # submodule (12 s of a 30-layer model's load)
        gguf_names = get_tensor_name_map(next(a for a, n in MODEL_ARCH_NAMES.items() if n == architecture),
                                         hf_config.num_hidden_layers)
        names = {}   # the file's names -> transformers'
        for name in model.state_dict():
            base, suffix = name.rsplit(".", 1)
            if (found := gguf_names.get_name(base)) is not None:
                names[f"{found}.{suffix}"] = name
        self.tensors = {names[t.name].removeprefix(PREFIX): t for t in reader.tensors if t.name in names}
        # a GGUF shape lists the fastest axis first
        self.shapes = {name: torch.Size(int(n) for n in reversed(t.shape))
                       for name, t in self.tensors.items()}

    @staticmethod
    def supports(path: Path, family_step: type, moe: bool) -> bool:
        """Whether a target's weights can be read one tensor at a time as ``transformers`` reads
        them: a dense step, and a tensor processor that only permutes rows (Llama's) or nothing."""
        from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, TensorProcessor

        from modeling.dense import TargetStep

        plain = _processor(_architecture(path)) in (TensorProcessor, LlamaTensorProcessor)
        return family_step is TargetStep and not moe and plain

    def load(self, name: str) -> torch.Tensor:
        """The float32 values of the module's weight ``name``, de-quantized from the file now."""
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        values = dequantize(tensor.data, tensor.tensor_type)
        values = np.ascontiguousarray(self.processor.process(weights=values, name=tensor.name).weights,
                                      dtype=np.float32)
        return torch.from_numpy(values if values.flags.writeable else values.copy())   # F32: the file's map


def _architecture(path: Path) -> str:
    """The GGUF file's architecture, as llama.cpp names it (``general.architecture``)."""
    return gguf_reader(path).fields["general.architecture"].contents()


def _processor(architecture: str) -> type:
    """The class of ``transformers``' tensor processor for a GGUF ``architecture``."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)


@contextmanager
def resident(module: torch.nn.Module, weights: LazyWeights | None):
    """Within the block ``module`` computes with its real weights (a no-op where ``weights`` is
    None: the module holds them): each of ``module.weight_units()`` (submodules that read their
    weights only when called: a decoder layer, a linear layer) reads its own as it is called and
    lets them go after, the others are read for the whole block."""
    if weights is None:
        yield
        return
    units = module.weight_units()
    # a tied weight is read under its first name (the module's other names for it are not read)
    first = {id(p): name for name, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
    owned = [[(first[id(p)], p) for p in unit.parameters()] for unit in units]
    in_units = {id(p) for parameters in owned for _, p in parameters}
    rest = [(name, p) for name, p in module.named_parameters() if id(p) not in in_units]

    def fill(parameters) -> None:
        for name, parameter in parameters:
            parameter.data = weights.load(name).to(parameter.dtype)

    def empty(parameters) -> None:
        for _, parameter in parameters:
            parameter.data = placeholder(parameter.shape, parameter.dtype)

    hooks = []
    for unit, own in zip(units, owned):
        hooks += [unit.register_forward_pre_hook(lambda *_, own=own: fill(own)),
                  unit.register_forward_hook(lambda *_, own=own: empty(own))]
    fill(rest)
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        empty(rest)
        for own in owned:
            empty(own)
