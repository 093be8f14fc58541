"""ONNX Runtime's form of a linear layer with the compiled kernels: each ``DequantizeLinear ->
MatMul`` that ``export/quantize.py`` writes (plus, for GGUF Q4_1, the input's block sums times
the offsets, added after it) becomes one ``dspark.cpu::QMatMul`` node, and each product by a
constant float32 weight (``MatMul``, ``MatMul`` of its ``Transpose``, ``Gemm`` with ``transB``)
one ``dspark.cpu::FMatMul``, their weights in the kernels' layouts (``layout.py``).

The rewrite happens when a graph is loaded, like the attention's (``block_attention/ort_contrib.py``):
the engine file keeps the standard form that every runtime reads, and a machine without the
kernel runs it on ONNX Runtime's own ``MatMulNBits``.
"""
from __future__ import annotations

import numpy as np

from .layout import pack, pack_float, supported

DOMAIN, OP = "dspark.cpu", "QMatMul"
BITS = {"INT4": 4, "INT8": 8}


def lower(model) -> dict[str, np.ndarray]:
    """Replace, in ``model`` (``onnx_ir.Model``) main graph, every float32 linear layer the kernel
    takes (``layout.supported``) by a ``QMatMul``, and every float32 product by a constant by an
    ``FMatMul``. Returns the new weights by name: the graph holds them as external data of the
    ``PACKED`` file, which ``packed_file`` makes for the session to be given in memory."""
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
    packed_weights |= _lower_float_products(graph)
    for name, offset in _offsets_of(packed_weights).items():   # their places in ``packed_file``
        _placeholder(graph, name, packed_weights[name], offset)
    if packed_weights:
        model.opset_imports[DOMAIN] = 1
        # the DequantizeLinear and block sums, and their weights
        onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
    return packed_weights


def _lower_float_products(graph) -> dict[str, np.ndarray]:
    """Each float32 product by a constant weight as ``FMatMul`` (a ``Gemm``'s bias added after it);
    a weight several products read is packed once."""
    import onnx_ir as ir

    packed: dict[str, np.ndarray] = {}
    for node in list(graph):
        found = _float_weight(node)
        if found is None:
            continue
        weight, transposed = found
        name = f"{weight.name}{'_t' if transposed else ''}_fmatmul"
        if name not in packed:
            matrix = weight.const_value.numpy()
            packed[name] = pack_float(matrix.T if transposed else matrix)
            _placeholder(graph, name, packed[name])
        columns = weight.const_value.shape[0 if transposed else 1]
        new = [ir.node("FMatMul", [node.inputs[0], graph.initializers[name]], domain=DOMAIN,
                       attributes={"columns": columns}, name=f"{node.name}_fmatmul")]
        if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:
            new.append(ir.node("Add", [new[0].outputs[0], node.inputs[2]], name=f"{node.name}_bias"))
        ir.convenience.replace_nodes_and_values(graph, node, [node], new, node.outputs, new[-1].outputs)
    return packed


def _float_weight(node):
    """``linear_weight(node)`` where the input and the weight are float32, else None."""
    found = linear_weight(node)
    if (found is None or found[0].const_value.dtype.name != "FLOAT"
            or node.inputs[0].dtype is None or node.inputs[0].dtype.name != "FLOAT"):
        return None
    return found


def linear_weight(node) -> tuple[object, bool] | None:
    """``(weight value, stored transposed)`` when ``node`` is a linear layer with a constant 2-D
    weight (``MatMul`` of it or of its ``Transpose``, or ``Gemm(transB=1)`` with unit alpha and
    beta), else None: what ``export/quantize.py`` quantizes and ``FMatMul`` takes. A weight the
    tracer shares between layers (the draft's K/V projections, the Markov head of every unrolled
    draft) reaches them through one ``Transpose`` of the constant."""
    if node.domain not in ("", "ai.onnx") or len(node.inputs) < 2 or node.inputs[1] is None:
        return None
    weight, transposed = node.inputs[1], False
    producer = weight.producer()
    if (node.op_type == "MatMul" and producer is not None and producer.op_type == "Transpose"
            and [int(p) for p in producer.attributes.get_ints("perm", [])] == [1, 0]):
        weight, transposed = producer.inputs[0], True
    if not weight.is_initializer() or weight.const_value is None or len(weight.const_value.shape) != 2:
        return None
    if node.op_type == "MatMul":
        return weight, transposed
    attributes = {name: attr.value for name, attr in node.attributes.items()}
    if (node.op_type == "Gemm" and attributes.get("transB", 0) == 1 and not attributes.get("transA", 0)
            and attributes.get("alpha", 1.0) == 1.0 and attributes.get("beta", 1.0) == 1.0):
        return weight, True
    return None


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


PACKED = "packed-at-load"   # the packed weights' file, in memory only (``ort_session.py``)


def packed_file(packed: dict[str, np.ndarray]) -> np.ndarray:
    """The packed weights end to end, each at the offset its placeholder names (64-byte aligned)."""
    offsets = _offsets_of(packed)
    size = max((offsets[name] + array.nbytes for name, array in packed.items()), default=0)
    buffer = np.zeros(size, np.uint8)
    for name, array in packed.items():
        data = np.ascontiguousarray(array).view(np.uint8).ravel()
        buffer[offsets[name]:offsets[name] + data.size] = data
    return buffer


def _offsets_of(packed: dict[str, np.ndarray]) -> dict[str, int]:
    offsets, at = {}, 0
    for name, array in packed.items():
        offsets[name] = at
        at += -(-array.nbytes // 64) * 64
    return offsets


def _placeholder(graph, name: str, array: np.ndarray, offset: int = 0):
    """The initializer ``name``: ``array``'s type and shape, its data at ``offset`` of the
    ``PACKED`` file the session is given in memory (registered on first use, placed at the end)."""
    import onnx_ir as ir

    tensor = ir.ExternalTensor(PACKED, offset, array.nbytes, ir.DataType.from_numpy(array.dtype),
                               shape=ir.Shape(array.shape), name=name)
    if name in graph.initializers:
        graph.initializers[name].const_value = tensor
        return graph.initializers[name]
    value = ir.Value(name=name, const_value=tensor)
    graph.register_initializer(value)
    return value
