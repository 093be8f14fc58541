"""A GGUF target's weights left in the file until a computation needs them.

``transformers`` loads a GGUF target whole, de-quantized to float32: 8x a Q4 file's bytes, so an
8B file (32 GB in float32) cannot build on a 24 GB machine. A build needs the values three times
(the graph's initializers, the verify inputs' context, the reference outputs) and never all at
once, so the target's module holds ``placeholder``s (zero-stride views of one zero: no memory, and
``torch.export`` traces them as the weights they stand for), the traced graph's initializers read
the file one tensor at a time as they are written (``export.onnx_export.export_graph``), and
``resident(module, weights)`` gives the module its real weights while it computes: a decoder
layer's while that layer runs, the rest (embeddings, final norm, ``lm_head``) for the whole call.

Each tensor is de-quantized as ``transformers`` de-quantizes it (``gguf``'s ``dequantize``, then
its tensor processor: Llama's q / k rows back in the rotary layout), under the names its model
gives it, so the module computes what ``transformers``' own load would give it
(``tests/graphs/test_gguf.py``). Families whose processor does more than rename and permute (MoE
expert stacks, Gemma's norms) load whole, as before (``supports``).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

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
def resident(module: torch.nn.Module, weights: GgufWeights | None):
    """Within the block ``module`` computes with its real weights (a no-op where ``weights`` is
    None: the module holds them): each of ``module.layers`` reads its own as it is called and
    lets them go after, the others are read for the whole block."""
    if weights is None:
        yield
        return
    layered = {id(p) for layer in module.layers for p in layer.parameters()}
    rest = [(name, p) for name, p in module.named_parameters() if id(p) not in layered]

    def fill(parameters) -> None:
        for name, parameter in parameters:
            parameter.data = weights.load(name).to(parameter.dtype)

    def empty(parameters) -> None:
        for _, parameter in parameters:
            parameter.data = placeholder(parameter.shape, parameter.dtype)

    hooks = []
    for index, layer in enumerate(module.layers):
        own = list(layer.named_parameters(prefix=f"layers.{index}"))
        hooks += [layer.register_forward_pre_hook(lambda *_, own=own: fill(own)),
                  layer.register_forward_hook(lambda *_, own=own: empty(own))]
    fill(rest)
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        empty(rest)
        for layer in module.layers:
            empty(layer.named_parameters())
