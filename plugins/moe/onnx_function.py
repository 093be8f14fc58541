"""``dspark::MoeExperts`` in ONNX: schema, the standard-op function body that ONNX Runtime runs,
and the exporter's translation. The body is a ``Loop`` over ``Unique(experts)`` (ascending), built
with ``onnx.helper`` (onnxscript writes no loops over computed trip counts with scatter updates):
per expert, ``NonZero`` finds its tokens, ``Gather`` takes them and the expert's two matrices,
two ``Gemm(transB=1)`` apply them as stored, and ``ScatterND`` writes its rows of the carried
output with the weighted rows added (ONNX Runtime has no fp16 ``reduction="add"`` on the CPU).

``MoeExpertsInt8`` / ``MoeExpertsInt4`` (``build --weights``) take each matrix as integers in
blocks along its input axis with one scale per block (``export/qdq.py`` writes them; the
layout is ``_quantized_product``'s) and compute with only the experts they gather. ONNX has no
``Gather`` of ``int4``, so int4 comes packed two to a byte and is unpacked with bit ops."""
from __future__ import annotations

from typing import Callable

import onnx
from onnx import AttributeProto, TensorProto, helper
from onnx.defs import OpSchema
from onnxscript.values import Opset

from ..onnx_domain import DOMAIN, DOMAIN_VERSION, FLOAT_TYPES, PLUGIN_ATTRIBUTES, register_schema
from . import NAME

INPUTS = ["x", "experts", "weights", "gate_up", "down"]
OUTPUTS = ["out"]
QUANTIZED_INPUTS = ["x", "experts", "weights", "gate_up_q", "gate_up_scales", "down_q", "down_scales"]
BITS = (8, 4)   # int4 two to a byte, stored as int8: TensorRT's parser widens uint8 constants to int32

_DOC = ("The routed experts of a MoE layer, only those selected: out_t = sum_j weights[t, j] * "
        "down[e] @ (act(gate) * up), gate, up = split(gate_up[e] @ x_t), e = experts[t, j]; act is "
        "SiLU (activation 0) or the tanh-approximated GELU (1); see plugins/moe/reference.py.")
ATTRIBUTES = [("activation", OpSchema.AttrType.INT)]
register_schema(
    NAME,
    inputs=[("x", "T"), ("experts", "tensor(int64)"), ("weights", "T"), ("gate_up", "T"), ("down", "T")],
    outputs=[("out", "T")],
    type_constraints=[("T", FLOAT_TYPES, "activation and weight type")],
    attributes=ATTRIBUTES, doc=_DOC,
)
for _bits in BITS:
    register_schema(
        f"{NAME}Int{_bits}",
        inputs=[("x", "T"), ("experts", "tensor(int64)"), ("weights", "T"), ("gate_up_q", "tensor(int8)"),
                ("gate_up_scales", "T"), ("down_q", "tensor(int8)"), ("down_scales", "T")],
        outputs=[("out", "T")],
        type_constraints=[("T", FLOAT_TYPES, "activation and scale type")],
        attributes=ATTRIBUTES,
        doc=f"{_DOC} Each matrix [N, K] is int{_bits} as [E, K/b, b, N]"
            + (" (packed [E, K/b, b/2, N]: row j low, j + b/2 high, each plus 8)" if _bits == 4 else "")
            + " with scales [E, K/b, N].",
    )
dspark = Opset(DOMAIN, DOMAIN_VERSION)


def _ints(name: str, values: list[int]):
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(
        name, TensorProto.INT64, [len(values)], values))


Product = Callable[[str, str, str], list[onnx.NodeProto]]


def _float_product(matrix: str, x: str, y: str) -> list[onnx.NodeProto]:
    """``y [n, N] = x [n, K] @ matrix[e]ᵀ``, expert ``e_expert``'s matrix ``[N, K]`` as stored."""
    node = helper.make_node
    return [node("Gather", [matrix, "e_expert"], [f"e_{matrix}"], axis=0),
            node("Gemm", [x, f"e_{matrix}"], [y], transB=1)]


def _quantized_product(bits: int) -> Product:
    """The same product from the expert's integers ``[K/b, b, N]`` (int4: ``[K/b, b/2, N]`` bytes,
    block row ``j`` in the low nibble and ``j + b/2`` in the high one, each plus 8, the byte's bits
    stored as an int8) and scales
    ``[K/b, N]``, in fp32: per block ``x_block @ integers`` (a batched ``MatMul``), less
    ``8 · sum(x_block)`` for int4, times the block's scales, summed over the blocks. The weights
    are cast once and never scaled or shifted as a whole: on the CPU each pass over an expert's
    values costs as much as its product (``scripts/moe_cost.py``)."""
    node = helper.make_node

    def product(matrix: str, x: str, y: str) -> list[onnx.NodeProto]:
        q, scales, p = f"e_{matrix}_q", f"e_{matrix}_scales", f"e_{matrix}"
        nodes = [node("Gather", [f"{matrix}_q", "e_expert"], [q], axis=0),
                 node("Gather", [f"{matrix}_scales", "e_expert"], [scales], axis=0)]
        if bits == 4:   # the bytes as uint8 (a cast that keeps the bits), then their two nibbles
            nodes += [node("Cast", [q], [f"{q}_bytes"], to=TensorProto.UINT8),
                      node("BitwiseAnd", [f"{q}_bytes", "e_low_mask"], [f"{q}_low"]),
                      node("BitShift", [f"{q}_bytes", "e_four"], [f"{q}_high"], direction="RIGHT"),
                      node("Concat", [f"{q}_low", f"{q}_high"], [f"{q}_unpacked"], axis=1)]   # [K/b, b, N]
            q = f"{q}_unpacked"
        nodes += [
            node("Cast", [q], [f"{p}_ints"], to=TensorProto.FLOAT),
            node("Shape", [f"{p}_ints"], [f"{p}_shape"], end=2),                              # [K/b, b]
            node("Concat", ["e_keep", f"{p}_shape"], [f"{p}_x_shape"], axis=0),               # [0, K/b, b]
            node("Cast", [x], [f"{p}_x"], to=TensorProto.FLOAT),
            node("Reshape", [f"{p}_x", f"{p}_x_shape"], [f"{p}_x_blocked"]),
            node("Transpose", [f"{p}_x_blocked"], [f"{p}_x_blocks"], perm=[1, 0, 2]),          # [K/b, n, b]
            node("MatMul", [f"{p}_x_blocks", f"{p}_ints"], [f"{p}_by_block"]),                # [K/b, n, N]
        ]
        by_block = f"{p}_by_block"
        if bits == 4:
            nodes += [node("ReduceSum", [f"{p}_x_blocks", "e_last"], [f"{p}_x_sums"], keepdims=1),
                      node("Mul", [f"{p}_x_sums", "e_eight"], [f"{p}_offsets"]),
                      node("Sub", [by_block, f"{p}_offsets"], [f"{p}_by_block_signed"])]
            by_block = f"{p}_by_block_signed"
        return nodes + [
            node("Cast", [scales], [f"{scales}_float"], to=TensorProto.FLOAT),
            node("Unsqueeze", [f"{scales}_float", "e_axis1"], [f"{scales}_3d"]),               # [K/b, 1, N]
            node("Mul", [by_block, f"{scales}_3d"], [f"{p}_scaled"]),
            node("ReduceSum", [f"{p}_scaled", "e_first"], [f"{p}_sum"], keepdims=0),
            node("CastLike", [f"{p}_sum", x], [y]),
        ]

    return product


def _quantized_constants(bits: int) -> list[onnx.NodeProto]:
    def constant(name: str, kind: int, value) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, kind, [], [value]))

    unpacking = [constant("e_low_mask", TensorProto.UINT8, 15), constant("e_four", TensorProto.UINT8, 4),
                 constant("e_eight", TensorProto.FLOAT, 8.0)]
    return [_ints("e_keep", [0]), *(unpacking if bits == 4 else [])]


def _gated(gate: str, up: str, out: str) -> list[onnx.NodeProto]:
    """``out = act(gate) * up``, ``act`` as ``gate * sigmoid(z)``: SiLU with ``z = gate``, the
    tanh-approximated GELU with ``z = 2 sqrt(2 / pi) (gate + 0.044715 gate^3)`` (the same function
    as ``0.5 gate (1 + tanh(z / 2))``), chosen by ``is_gelu``, the function's ``activation``."""
    node = helper.make_node

    def constant(name: str, value: float) -> list[onnx.NodeProto]:
        return [node("Constant", [], [f"{name}_float"], value_float=value),
                node("CastLike", [f"{name}_float", gate], [name])]

    return [*constant("e_cubic", 0.044715), *constant("e_gelu_scale", 1.5957691216057308),
            node("Mul", [gate, gate], ["e_gate_squared"]),
            node("Mul", ["e_gate_squared", gate], ["e_gate_cubed"]),
            node("Mul", ["e_gate_cubed", "e_cubic"], ["e_cubic_term"]),
            node("Add", [gate, "e_cubic_term"], ["e_gelu_inner"]),
            node("Mul", ["e_gelu_inner", "e_gelu_scale"], ["e_gelu_z"]),
            node("Where", ["is_gelu", "e_gelu_z", gate], ["e_z"]),
            node("Sigmoid", ["e_z"], ["e_sigmoid"]),
            node("Mul", [gate, "e_sigmoid"], ["e_act"]),
            node("Mul", ["e_act", up], [out])]


def _expert_body(product: Product, constants: list[onnx.NodeProto]) -> onnx.GraphProto:
    """Iteration ``i``: expert ``selected[i]``'s tokens through its gated MLP, weighted, added to
    ``acc [T, H]``; ``product(matrix, x, y)`` applies one of the expert's two matrices."""
    node = helper.make_node
    nodes = [
        *constants, _ints("e_axis1", [1]), _ints("e_last", [-1]), _ints("e_first", [0]),
        node("Gather", ["selected", "i"], ["e_expert"], axis=0),               # a scalar id
        node("Equal", ["experts", "e_expert"], ["e_hit"]),                    # [T, k]
        node("Cast", ["e_hit"], ["e_hit_float"], to=TensorProto.FLOAT),
        node("ReduceMax", ["e_hit_float", "e_axis1"], ["e_routed"], keepdims=0),   # [T]
        node("NonZero", ["e_routed"], ["e_rows_2d"]),                         # [1, n]
        node("Squeeze", ["e_rows_2d", "e_first"], ["e_rows"]),
        node("CastLike", ["e_hit", "weights"], ["e_hit_weights"]),
        node("Mul", ["weights", "e_hit_weights"], ["e_weights_kept"]),
        node("ReduceSum", ["e_weights_kept", "e_axis1"], ["e_weight"], keepdims=0),  # [T]
        # the products run on n + 1 rows, the first repeated, and the copy is dropped: ONNX Runtime
        # multiplies one row with another kernel than several, which rounds it differently, and
        # an expert's n varies with the call (runtime/backends/ort.py)
        node("Slice", ["e_rows", "e_first", "e_axis1"], ["e_first_row"]),
        node("Concat", ["e_rows", "e_first_row"], ["e_rows_padded"], axis=0),
        node("Gather", ["x", "e_rows_padded"], ["e_x"], axis=0),              # [n + 1, H]
        *product("gate_up", "e_x", "e_h"),                                    # [n + 1, 2I]
        node("Split", ["e_h"], ["e_gate", "e_up"], axis=-1, num_outputs=2),
        *_gated("e_gate", "e_up", "e_a"),
        *product("down", "e_a", "e_y_padded"),                                # [n + 1, H]
        node("Shape", ["e_rows"], ["e_count"]),
        node("Slice", ["e_y_padded", "e_first", "e_count"], ["e_y"]),         # [n, H]
        node("Gather", ["e_weight", "e_rows"], ["e_row_weight"], axis=0),
        node("Unsqueeze", ["e_row_weight", "e_last"], ["e_row_weight_2d"]),
        node("Mul", ["e_y", "e_row_weight_2d"], ["e_weighted"]),
        # an expert takes each token at most once: its rows are written as they are summed
        node("Gather", ["acc", "e_rows"], ["e_before"], axis=0),
        node("Add", ["e_before", "e_weighted"], ["e_after"]),
        node("Unsqueeze", ["e_rows", "e_last"], ["e_index"]),
        node("ScatterND", ["acc", "e_index", "e_after"], ["acc_next"]),
        node("Identity", ["cond"], ["cond_next"]),
    ]
    value = helper.make_tensor_value_info
    # the output's element type is the function's T, known only where it is called: left untyped
    return helper.make_graph(
        nodes, "moe_expert",
        [value("i", TensorProto.INT64, []), value("cond", TensorProto.BOOL, []),
         onnx.ValueInfoProto(name="acc")],
        [value("cond_next", TensorProto.BOOL, []), onnx.ValueInfoProto(name="acc_next")])


def _int_attribute(name: str) -> onnx.NodeProto:
    """A ``Constant`` whose value is the function's integer attribute ``name``."""
    value = onnx.AttributeProto(name="value_int", type=AttributeProto.INT, ref_attr_name=name)
    constant = helper.make_node("Constant", [], [name])
    constant.attribute.append(value)
    return constant


def _function(name: str, inputs: list[str], product: Product,
              constants: list[onnx.NodeProto] = ()) -> onnx.FunctionProto:
    node = helper.make_node
    nodes = [
        _ints("flat", [-1]),
        node("Reshape", ["experts", "flat"], ["all_selected"]),
        node("Unique", ["all_selected"], ["selected"], sorted=1),
        node("Shape", ["selected"], ["count_1d"]),
        node("Squeeze", ["count_1d"], ["count"]),
        node("Constant", [], ["true"], value=helper.make_tensor("true", TensorProto.BOOL, [], [True])),
        node("Constant", [], ["zero"], value=helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])),
        node("CastLike", ["zero", "x"], ["zero_like"]),
        node("Shape", ["x"], ["x_shape"]),
        node("Expand", ["zero_like", "x_shape"], ["acc0"]),
        # the attribute read here, where the function's own nodes may refer to it, for the loop body
        _int_attribute("activation"),
        node("Cast", ["activation"], ["is_gelu"], to=TensorProto.BOOL),
        node("Loop", ["count", "true", "acc0"], ["out"], body=_expert_body(product, list(constants))),
    ]
    return helper.make_function(DOMAIN, name, inputs, OUTPUTS, nodes, [helper.make_opsetid("", 23)],
                                attributes=["activation"])


class MoeExperts:
    """What the exporter attaches for each ``dspark`` node type: its name and function proto."""
    name = NAME

    @staticmethod
    def to_function_proto() -> onnx.FunctionProto:
        return _function(NAME, INPUTS, _float_product)


def quantized_function(bits: int) -> onnx.FunctionProto:
    """``MoeExpertsInt{bits}``'s function proto."""
    return _function(f"{NAME}Int{bits}", QUANTIZED_INPUTS, _quantized_product(bits),
                     _quantized_constants(bits))


def translate(x, experts, weights, gate_up, down, activation: int = 0):
    """``torch.ops.dspark.moe_experts`` -> one ``dspark::MoeExperts`` node."""
    return dspark.MoeExperts(x, experts, weights, gate_up, down, activation=int(activation),
                             **PLUGIN_ATTRIBUTES)
