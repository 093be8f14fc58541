"""ONNX Runtime's form of a MoE layer with the compiled kernels: each ``dspark::MoeExperts`` node
whose expert stacks are constants becomes one ``dspark.cpu`` op that runs each selected expert's
tokens through the dense layers' kernels (``plugins/cpu/ort_ops.cpp``), each expert's two matrices
repacked at load time in their kernel's layout (``plugins/qmatmul/layout.py``) and stacked on an
expert axis:

- ``MoeExpertsInt4`` / ``Int8`` (``build --weights``, blocks of 32, float32 activations) ->
  ``QMoeExperts``, on ``QMatMul``'s kernel;
- ``MoeExperts`` of float32 / fp16 experts -> ``FMoeExperts`` / ``HMoeExperts``, on ``FMatMul``'s
  kernel, fp16 weights kept in fp16.

A token's output then does not depend on the tokens beside it. Elsewhere the node keeps its ONNX
function, a ``Loop`` over the selected experts that de-quantizes (or casts) each one's weights to
float32 (``onnx_function.py``).
"""
from __future__ import annotations

import numpy as np

from ..qmatmul.layout import BLOCK, pack, pack_float, supported
from ..qmatmul.ort_lowering import DOMAIN, placeholder
from . import MATRICES, NAME

FLOAT_OPS = {"FLOAT": "FMoeExperts", "FLOAT16": "HMoeExperts"}   # the experts' type -> the op


def lower(model, location: str) -> dict[str, np.ndarray]:
    """Replace, in ``model`` (``onnx_ir.Model``) main graph, each ``MoeExperts`` node the kernels
    take by its ``dspark.cpu`` op. Returns the packed weights by name, held in the graph as
    ``qmatmul.lower``'s are (external data at ``location``)."""
    import onnx_ir as ir
    import onnx_ir.passes.common

    graph, packed = model.graph, {}
    for node in list(graph):
        if node.domain != "dspark" or not all(v.is_initializer() and v.const_value is not None
                                              for v in node.inputs[3:]):
            continue
        bits = {f"{NAME}Int{b}": b for b in (4, 8)}.get(node.op_type)
        if bits is not None:
            found = _quantized(node, bits)
        elif node.op_type == NAME:
            found = _float(node)
        else:
            continue
        if found is None:
            continue
        op, arrays, intermediate = found
        inputs = list(node.inputs[:3])
        for name, array in arrays.items():
            packed[f"{node.name}_{name}"] = array
            inputs.append(placeholder(graph, f"{node.name}_{name}", array, location))
        activation = node.attributes.get("activation")
        new = ir.node(op, inputs, domain=DOMAIN, name=f"{node.name}_cpu", attributes={
            "intermediate": intermediate, "activation": activation.value if activation is not None else 0})
        ir.convenience.replace_nodes_and_values(graph, node, [node], [new], node.outputs, new.outputs)
    if packed:
        model.opset_imports[DOMAIN] = 1
        onnx_ir.passes.common.RemoveUnusedNodesPass()(model)   # the stacks as the graph held them
    return packed


def _quantized(node, bits: int):
    """``("QMoeExperts", packed arrays, I)`` for float32 experts in blocks of 32, else None."""
    import onnx_ir as ir

    if node.inputs[0].dtype != ir.DataType.FLOAT:
        return None
    stacks = node.inputs[3:]
    matrices = [_unpacked(stacks[2 * i].const_value.numpy(), bits) for i in range(2)]
    scales = [stacks[2 * i + 1].const_value.numpy() for i in range(2)]
    if not all(q.shape[1] == BLOCK * s.shape[1] and supported(q.reshape(-1, q.shape[-1]), BLOCK, bits)
               for q, s in zip(matrices, scales)):
        return None
    arrays = {}
    for matrix, q, s in zip(MATRICES, matrices, scales):
        experts = [pack(q[e], s[e], bits) for e in range(len(q))]
        arrays |= {f"{matrix}_{part}": np.stack([getattr(e, part) for e in experts])
                   for part in ("q", "scales", "sums")}
    return "QMoeExperts", arrays, matrices[1].shape[1]


def _float(node):
    """``("FMoeExperts" | "HMoeExperts", packed arrays, I)`` for float32 or fp16 experts (each
    matrix stored ``[N, K]``, as ``nn.Linear`` stores it) of x's type, else None."""
    gate_up, down = (v.const_value for v in node.inputs[3:5])
    op = FLOAT_OPS.get(gate_up.dtype.name)
    if op is None or node.inputs[0].dtype != gate_up.dtype or down.dtype != gate_up.dtype:
        return None
    arrays = {matrix: np.stack([pack_float(m, transposed=True) for m in stack.numpy()])
              for matrix, stack in zip(MATRICES, (gate_up, down))}
    return op, arrays, down.shape[2]


def _unpacked(q: np.ndarray, bits: int) -> np.ndarray:
    """``MoeExpertsInt{bits}``'s integers ``[E, K / b, b, N]`` (int4: ``[E, K / b, b / 2, N]``
    bytes, block row ``j`` low and ``j + b / 2`` high, each plus 8) -> int8 ``[E, K, N]``."""
    if bits == 4:
        unsigned = q.view(np.uint8)
        q = np.concatenate([(unsigned & 15).astype(np.int8) - 8, (unsigned >> 4).astype(np.int8) - 8], axis=2)
    return q.reshape(q.shape[0], -1, q.shape[-1])
