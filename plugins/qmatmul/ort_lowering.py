"""ONNX Runtime's form of a linear layer with the compiled kernels: each ``DequantizeLinear ->
MatMul`` that ``export/qdq.py`` writes (plus, for GGUF formats with offsets, the input's block sums times
the offsets, added after it; for a K-quant, its scales and offsets made from the file's integers,
which the kernel reads as they are) becomes one ``dspark.cpu::QMatMul`` node, and each product by a
constant float32 weight (``MatMul``, ``MatMul`` of its ``Transpose``, ``Gemm`` with ``transB``)
one ``dspark.cpu::FMatMul`` (an fp16 one ``HMatMul``, its weight kept in fp16), their weights in
the kernels' layouts (``layout.py``).

The rewrite happens when a graph is loaded, like the attention's (``block_attention/ort_contrib.py``):
the engine file keeps the standard form that every runtime reads, and a machine without the
kernel runs it on ONNX Runtime's own ``MatMulNBits``.
"""
from __future__ import annotations

import numpy as np

from .layout import BLOCK, SUPER, KQuantScales, pack, pack_float, supported

DOMAIN, OP = "dspark.cpu", "QMatMul"
BITS = {"INT4": 4, "INT8": 8}


def lower(model, location: str) -> dict[str, np.ndarray]:
    """Replace, in ``model`` (``onnx_ir.Model``) main graph, every float32 linear layer the kernel
    takes (``layout.supported``) by a ``QMatMul``, and every float32 or fp16 product by a constant
    by an ``FMatMul`` or ``HMatMul``. Returns the new weights by name, which the session is to be
    given as they are (``ort_session.py``): the graph holds each as external data at
    ``location``, a file that must exist beside the graph (ONNX Runtime checks that, and reads
    nothing from it)."""
    import onnx_ir as ir
    import onnx_ir.passes.common

    graph, packed_weights = model.graph, {}
    for node in list(graph):
        found = _quantized_product(node)
        if found is None:
            continue
        dq, q, scales, bits, block = found
        weights = _int8_values(q)
        offsets, last = _offsets(node)
        made = _scales(scales, offsets)
        if made is None or not supported(weights, block, bits):
            continue
        if block != BLOCK:   # Q6_K's half blocks: packed as 6 bits, with the file's scales only
            if not isinstance(made[0], KQuantScales):
                continue
            bits = 6
        packed = pack(weights, made[0], bits, made[1])
        stem = q.name.removesuffix("_q")
        arrays = {f"{stem}_qmatmul_{part}": getattr(packed, part)
                  for part in ("q", "scales", "offsets", "sums", "sub", "super")}
        inputs = [node.inputs[0]] + [placeholder(graph, name, array, location)
                                     for name, array in arrays.items()]
        new = ir.node(OP, inputs, domain=DOMAIN, attributes={"columns": packed.n, "middle": packed.middle},
                      name=f"{node.name}_qmatmul")
        replaced = [node] if last is node else [node, offsets.uses()[0].node, last]
        ir.convenience.replace_nodes_and_values(graph, node, replaced, [new], [last.outputs[0]], new.outputs)
        packed_weights |= arrays
    packed_weights |= _lower_float_products(graph, location)
    if packed_weights:
        model.opset_imports[DOMAIN] = 1
        # the DequantizeLinear and block sums, and their weights
        onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
    return packed_weights


def _lower_float_products(graph, location: str) -> dict[str, np.ndarray]:
    """Each float32 (fp16) product by a constant weight as ``FMatMul`` (``HMatMul``), a ``Gemm``'s
    bias added after it; a weight several products read is packed once."""
    import onnx_ir as ir

    packed: dict[str, np.ndarray] = {}
    for node in list(graph):
        found = _float_weight(node)
        if found is None:
            continue
        weight, transposed = found
        name = f"{weight.name}{'_t' if transposed else ''}_fmatmul"
        if name not in packed:
            packed[name] = pack_float(weight.const_value.numpy(), transposed)
            placeholder(graph, name, packed[name], location)
        columns = weight.const_value.shape[0 if transposed else 1]
        op = FLOAT_OPS[weight.const_value.dtype.name]
        new = [ir.node(op, [node.inputs[0], graph.initializers[name]], domain=DOMAIN,
                       attributes={"columns": columns}, name=f"{node.name}_fmatmul")]
        if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:
            new.append(ir.node("Add", [new[0].outputs[0], node.inputs[2]], name=f"{node.name}_bias"))
        ir.convenience.replace_nodes_and_values(graph, node, [node], new, node.outputs, new[-1].outputs)
    return packed


FLOAT_OPS = {"FLOAT": "FMatMul", "FLOAT16": "HMatMul"}   # the weight's type -> the op


def _float_weight(node):
    """``linear_weight(node)`` where the input and the weight are both float32 or both fp16,
    else None."""
    found = linear_weight(node)
    if (found is None or found[0].const_value.dtype.name not in FLOAT_OPS
            or node.inputs[0].dtype != found[0].const_value.dtype):
        return None
    return found


def linear_weight(node) -> tuple[object, bool] | None:
    """``(weight value, stored transposed)`` when ``node`` is a linear layer with a constant 2-D
    weight (``MatMul`` of it or of its ``Transpose``, or ``Gemm(transB=1)`` with unit alpha and
    beta), else None: what ``export/qdq.py`` quantizes and ``FMatMul`` takes. A weight the
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
    if not (q.is_initializer() and q.const_value is not None):
        return None
    attributes = {name: attr.value for name, attr in dq.attributes.items()}
    bits = BITS.get(q.const_value.dtype.name)
    if (bits is None or len(q.const_value.shape) != 2 or attributes.get("axis", 1) != 0
            or "block_size" not in attributes):
        return None
    return dq, q, scales, bits, attributes["block_size"]


def _int8_values(value) -> np.ndarray:
    """A quantized weight's values as int8, read from its file without ``onnx_ir``'s copy: it
    keeps the array it reads for as long as the tensor lives (an int4 weight unpacked through
    ``ml_dtypes``, a slow cast, to a byte a value), and a replaced node's tensors live until the
    collector reaches the graph's cycles. An int8 weight stays the file's mapped pages."""
    import onnx_ir as ir

    tensor = value.const_value
    if not isinstance(tensor, ir.ExternalTensor):
        return tensor.numpy().astype(np.int8)
    stored = np.memmap(tensor.path, np.uint8, "r", tensor.offset or 0, (tensor.nbytes,))
    shape = tensor.shape.numpy()
    if tensor.dtype == ir.DataType.INT8:
        return stored.view(np.int8).reshape(shape)
    values = np.empty(2 * len(stored), np.int8)   # int4: two to a byte, the first in the low nibble
    values[0::2] = (stored << 4).view(np.int8) >> 4
    values[1::2] = stored.view(np.int8) >> 4
    return values[:tensor.size].reshape(shape)


def _constant(value, dtype: str, rank: int) -> np.ndarray | None:
    """``value``'s array when it is a constant of that type and rank, else None."""
    if value is None or not value.is_initializer() or value.const_value is None:
        return None
    array = value.const_value
    return array.numpy() if array.dtype.name == dtype and len(array.shape) == rank else None


def _scales(scales, offsets) -> tuple[np.ndarray | KQuantScales, np.ndarray | None] | None:
    """A quantized product's scales (float32 constants, or a K-quant's, which make its offsets
    too: ``export/qdq.py``'s ``_kquant_scales``) and offsets (float32 constants, or None), as
    ``pack`` takes them; None when they are of another form."""
    plain, offset_table = _constant(scales, "FLOAT", 2), _constant(offsets, "FLOAT", 2)
    if plain is not None and (offsets is None or offset_table is not None):
        return plain, offset_table
    made = _dequantized_integers(scales)
    if made is not None and offsets is None and made[0].dtype == np.int8 and made[2] == 2 * SUPER:
        return KQuantScales(made[0], None, made[1], None, 32), None   # Q6_K
    if made is None or made[2] != SUPER:
        return None
    difference = None if offsets is None else offsets.producer()
    if difference is None or difference.op_type != "Sub":
        return None
    shifted, mins = difference.inputs[0].producer(), _dequantized_integers(difference.inputs[1])
    if (shifted is None or shifted.op_type != "Mul" or list(shifted.inputs)[:1] != [scales] or mins is None
            or mins[2] != SUPER):
        return None
    middle = _constant(shifted.inputs[1], "FLOAT", 0)
    if middle is None or float(middle) != int(middle):
        return None
    return KQuantScales(made[0], mins[0], made[1], mins[1], int(middle)), None


def _dequantized_integers(value) -> tuple[np.ndarray, np.ndarray, int] | None:
    """``(integers, scales, block)`` where ``value`` is a ``DequantizeLinear`` of uint8 or int8
    constants by float32 ones in blocks along axis 0 (a K-quant's scales or minimums), else None."""
    node = None if value is None else value.producer()
    if node is None or node.op_type != "DequantizeLinear" or (len(node.inputs) > 2
                                                              and node.inputs[2] is not None):
        return None
    attributes = {name: attr.value for name, attr in node.attributes.items()}
    integers = _constant(node.inputs[0], "UINT8", 2)
    integers = _constant(node.inputs[0], "INT8", 2) if integers is None else integers
    scales = _constant(node.inputs[1], "FLOAT", 2)
    if integers is None or scales is None or attributes.get("axis", 1) != 0 or "block_size" not in attributes:
        return None
    return integers, scales, attributes["block_size"]


def _offsets(node):
    """``(offsets, last node)``: a GGUF layer's ``Add(node, MatMul(block sums, offsets))`` (Q4_1,
    Q5_1, Q4_K, Q5_K) gives its offsets (constants, or a K-quant's made from its integers) and the
    ``Add``; any other layer ``(None, node)``."""
    uses = node.outputs[0].uses()
    if len(uses) != 1 or uses[0].node.op_type != "Add":
        return None, node
    add = uses[0].node
    other = add.inputs[1 - uses[0].idx].producer()
    if other is None or other.op_type != "MatMul" or len(other.outputs[0].uses()) != 1:
        return None, node
    offsets = other.inputs[1]
    if len(offsets.uses()) != 1:
        return None, node
    return offsets, add


def placeholder(graph, name: str, array: np.ndarray, location: str):
    """The initializer ``name``: ``array``'s type and shape, as external data at ``location``
    (``lower`` says why)."""
    import onnx_ir as ir

    tensor = ir.ExternalTensor(location, 0, array.nbytes, ir.DataType.from_numpy(array.dtype),
                               shape=ir.Shape(array.shape), name=name)
    value = ir.Value(name=name, const_value=tensor)
    graph.register_initializer(value)
    return value
