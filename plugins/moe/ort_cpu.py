"""ONNX Runtime's form of a quantized MoE layer with the compiled kernels: each
``dspark::MoeExpertsInt4`` / ``Int8`` node (``export/quantize.py`` writes them) whose expert stacks
are constants in blocks of 32 becomes one ``dspark.cpu::MoeExperts`` node, each expert's two
matrices repacked as ``QMatMul`` takes them (``plugins/qmatmul/layout.py``), stacked on an expert
axis. The op runs each selected expert's tokens through the same kernel as a dense layer, so a
token's output does not depend on the tokens beside it (``plugins/cpu/ort_ops.cpp``).

Elsewhere the node keeps its ONNX function, a ``Loop`` over the selected experts that de-quantizes
each one's blocks in float32 (``onnx_function.py``).
"""
from __future__ import annotations

import numpy as np

from ..qmatmul.layout import BLOCK, pack, supported
from ..qmatmul.ort_lowering import DOMAIN, placeholder
from .onnx_function import MATRICES, NAME

OP = "MoeExperts"


def lower(model, location: str) -> dict[str, np.ndarray]:
    """Replace, in ``model`` (``onnx_ir.Model``) main graph, each float32 ``MoeExpertsInt{bits}``
    whose experts the kernel takes by a ``dspark.cpu::MoeExperts``. Returns the packed weights by
    name, held in the graph as ``qmatmul.lower``'s are (external data at ``location``)."""
    import onnx_ir as ir
    import onnx_ir.passes.common

    graph, packed = model.graph, {}
    for node in list(graph):
        bits = {f"{NAME}Int{b}": b for b in (4, 8)}.get(node.op_type)
        if bits is None or node.domain != "dspark" or node.inputs[0].dtype != ir.DataType.FLOAT:
            continue
        stacks = node.inputs[3:]
        if not all(v.is_initializer() and v.const_value is not None for v in stacks):
            continue
        matrices = [_unpacked(stacks[2 * i].const_value.numpy(), bits) for i in range(2)]
        scales = [stacks[2 * i + 1].const_value.numpy() for i in range(2)]
        if not all(q.shape[1] == BLOCK * s.shape[1] and supported(q.reshape(-1, q.shape[-1]), BLOCK, bits)
                   for q, s in zip(matrices, scales)):
            continue
        inputs = list(node.inputs[:3])
        for matrix, q, s in zip(MATRICES, matrices, scales):
            experts = [pack(q[e], s[e], bits) for e in range(len(q))]
            for part in ("q", "scales", "sums"):
                name = f"{node.name}_{matrix}_{part}"
                packed[name] = np.stack([getattr(e, part) for e in experts])
                inputs.append(placeholder(graph, name, packed[name], location))
        new = ir.node(OP, inputs, domain=DOMAIN, attributes={"intermediate": matrices[1].shape[1]},
                      name=f"{node.name}_cpu")
        ir.convenience.replace_nodes_and_values(graph, node, [node], [new], node.outputs, new.outputs)
    if packed:
        model.opset_imports[DOMAIN] = 1
        onnx_ir.passes.common.RemoveUnusedNodesPass()(model)   # the integer stacks
    return packed


def _unpacked(q: np.ndarray, bits: int) -> np.ndarray:
    """``MoeExpertsInt{bits}``'s integers ``[E, K / b, b, N]`` (int4: ``[E, K / b, b / 2, N]``
    bytes, block row ``j`` low and ``j + b / 2`` high, each plus 8) -> int8 ``[E, K, N]``."""
    if bits == 4:
        unsigned = q.view(np.uint8)
        q = np.concatenate([(unsigned & 15).astype(np.int8) - 8, (unsigned >> 4).astype(np.int8) - 8], axis=2)
    return q.reshape(q.shape[0], -1, q.shape[-1])
