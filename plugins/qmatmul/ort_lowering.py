"""ONNX Runtime's form of a quantized linear layer with the compiled kernel: each
``DequantizeLinear -> MatMul`` that ``export/quantize.py`` writes (plus, for GGUF Q4_1, the
input's block sums times the offsets, added after it) becomes one ``dspark.cpu::QMatMul`` node
whose weights are in the kernel's layout (``layout.py``).

The rewrite happens when a graph is loaded, like the attention's (``block_attention/ort_contrib.py``):
the engine file keeps the standard form that every runtime reads, and a machine without the
kernel runs it on ONNX Runtime's own ``MatMulNBits``.
"""
from __future__ import annotations

import numpy as np

from .layout import pack, supported

DOMAIN, OP = "dspark.cpu", "QMatMul"
BITS = {"INT4": 4, "INT8": 8}


def lower(model) -> dict[str, np.ndarray]:
    """Replace, in ``model`` (``onnx_ir.Model``) main graph, every float32 linear layer the kernel
    takes (``layout.supported``) by a ``QMatMul``. Returns the new weights by name: the graph
    holds them as placeholders, for the session to be given them as arrays."""
    import onnx_ir as ir
    import onnx_ir.passes.common

    graph, packed_weights = model.graph, {}
    for node in list(graph):
        found = _quantized_product(node)
        if found is None:
            continue
        dq, q, scales, bits, block = found
        weights = q.const_value.numpy().astype(np.int8)
        if not supported(weights, block, bits):
            continue
        offsets, last = _offsets(node)
        packed = pack(weights, scales.const_value.numpy(), bits,
                      None if offsets is None else offsets.const_value.numpy())
        stem = q.name.removesuffix("_q")
        arrays = {f"{stem}_qmatmul_{part}": getattr(packed, part)
                  for part in ("q", "scales", "offsets", "sums")}
        inputs = [node.inputs[0]] + [_placeholder(graph, name, array) for name, array in arrays.items()]
        new = ir.node(OP, inputs, domain=DOMAIN, attributes={"columns": packed.n},
                      name=f"{node.name}_qmatmul")
        replaced = [node] if last is node else [node, offsets.uses()[0].node, last]
        ir.convenience.replace_nodes_and_values(graph, node, replaced, [new], [last.outputs[0]], new.outputs)
        packed_weights |= arrays
    if packed_weights:
        model.opset_imports[DOMAIN] = 1
        # the DequantizeLinear and block sums, and their weights
        onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
    return packed_weights


def float_products(model) -> int:
    """How many matrix products of ``model``'s main graph multiply by a constant weight other
    than through the kernel (``MatMul`` / ``Gemm`` of an initializer, or of its ``Transpose``)."""
    def constant(value) -> bool:
        producer = value.producer() if value is not None else None
        if producer is not None and producer.op_type == "Transpose":
            value = producer.inputs[0]
        return value is not None and value.is_initializer()

    return sum(node.op_type in ("MatMul", "Gemm") and node.domain in ("", "ai.onnx") and len(node.inputs) > 1
               and constant(node.inputs[1]) for node in model.graph)


def _quantized_product(node):
    """``(DequantizeLinear, q, scales, bits, block)`` when ``node`` is a float32 ``MatMul`` of an
    input by a blocked ``DequantizeLinear`` of constants (axis 0, no zero point) that it alone
    reads, else None."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or node.inputs[1] is None:
        return None
    weight = node.inputs[1]
    dq = weight.producer()
    if dq is None or dq.op_type != "DequantizeLinear" or len(weight.uses()) != 1:
        return None
    if len(dq.inputs) > 2 and dq.inputs[2] is not None:
        return None
    q, scales = dq.inputs[0], dq.inputs[1]
    if not all(v.is_initializer() and v.const_value is not None for v in (q, scales)):
        return None
    attributes = {name: attr.value for name, attr in dq.attributes.items()}
    bits = BITS.get(q.const_value.dtype.name)
    if (bits is None or scales.const_value.dtype.name != "FLOAT" or len(q.const_value.shape) != 2
            or attributes.get("axis", 1) != 0 or "block_size" not in attributes):
        return None
    return dq, q, scales, bits, attributes["block_size"]


def _offsets(node):
    """``(offsets, last node)``: a GGUF Q4_1 layer's ``Add(node, MatMul(block sums, offsets))``
    gives its constant offsets and the ``Add``; any other layer ``(None, node)``."""
    uses = node.outputs[0].uses()
    if len(uses) != 1 or uses[0].node.op_type != "Add":
        return None, node
    add = uses[0].node
    other = add.inputs[1 - uses[0].idx].producer()
    if other is None or other.op_type != "MatMul" or len(other.outputs[0].uses()) != 1:
        return None, node
    offsets = other.inputs[1]
    if not (offsets.is_initializer() and offsets.const_value is not None and len(offsets.uses()) == 1):
        return None, node
    return offsets, add


def _placeholder(graph, name: str, array: np.ndarray):
    """An initializer of ``array``'s type and shape whose data the session is given apart."""
    import onnx_ir as ir

    dtype = ir.DataType.from_numpy(array.dtype)
    tensor = ir.ExternalTensor("given-to-the-session", 0, array.nbytes, dtype, shape=ir.Shape(array.shape),
                               name=name)
    value = ir.Value(name=name, const_value=tensor)
    graph.register_initializer(value)
    return value
