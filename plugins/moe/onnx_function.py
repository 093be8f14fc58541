"""``dspark::MoeExperts`` in ONNX: schema, the standard-op function body that ONNX Runtime runs,
and the exporter's translation. The body is a ``Loop`` over ``Unique(experts)`` (ascending), built
with ``onnx.helper`` (onnxscript writes no loops over computed trip counts with scatter updates):
per expert, ``NonZero`` finds its tokens, ``Gather`` takes them and the expert's two matrices,
two ``Gemm(transB=1)`` apply them as stored, and ``ScatterND`` writes its rows of the carried
output with the weighted rows added (ONNX Runtime has no fp16 ``reduction="add"`` on the CPU).

``MoeExpertsInt8`` / ``MoeExpertsInt4`` (``build --weights``) take each matrix as integers and
one scale per block of values along its input axis (``export/quantize.py`` writes them; the block
is the input size over the scales' last axis) and de-quantize only the experts they gather. ONNX
has no ``Gather`` of ``int4``, so int4 comes packed two to a ``uint8`` (the even column in the
low nibble, stored plus 8) and is unpacked with bit ops."""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper
from onnxscript.values import Opset

from ..onnx_domain import DOMAIN, DOMAIN_VERSION, FLOAT_TYPES, PLUGIN_ATTRIBUTES, register_schema

NAME = "MoeExperts"
INPUTS = ["x", "experts", "weights", "gate_up", "down"]
OUTPUTS = ["out"]
MATRICES = ("gate_up", "down")
QUANTIZED_INPUTS = ["x", "experts", "weights", "gate_up_q", "gate_up_scales", "down_q", "down_scales"]
QUANTIZED_TYPES = {8: "tensor(int8)", 4: "tensor(uint8)"}   # int4: two to a byte

_DOC = ("The routed experts of a MoE layer, only those selected: out_t = sum_j weights[t, j] * "
        "down[e] @ (silu(gate) * up), gate, up = split(gate_up[e] @ x_t), e = experts[t, j]; see "
        "plugins/moe/reference.py.")
register_schema(
    NAME,
    inputs=[("x", "T"), ("experts", "tensor(int64)"), ("weights", "T"), ("gate_up", "T"), ("down", "T")],
    outputs=[("out", "T")],
    type_constraints=[("T", FLOAT_TYPES, "activation and weight type")],
    attributes=[], doc=_DOC,
)
for _bits, _type in QUANTIZED_TYPES.items():
    register_schema(
        f"{NAME}Int{_bits}",
        inputs=[("x", "T"), ("experts", "tensor(int64)"), ("weights", "T"), ("gate_up_q", _type),
                ("gate_up_scales", "T"), ("down_q", _type), ("down_scales", "T")],
        outputs=[("out", "T")],
        type_constraints=[("T", FLOAT_TYPES, "activation and scale type")],
        attributes=[],
        doc=f"{_DOC} Each matrix is int{_bits} with one scale per block along its input axis (last)"
            + (", packed two to a byte plus 8, the even column low." if _bits == 4 else "."),
    )
dspark = Opset(DOMAIN, DOMAIN_VERSION)


def _ints(name: str, values: list[int]):
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(
        name, TensorProto.INT64, [len(values)], values))


def _float_matrices() -> list[onnx.NodeProto]:
    """Expert ``e_expert``'s two matrices, ``e_gate_up [2I, H]`` and ``e_down [H, I]``, as stored."""
    return [helper.make_node("Gather", [m, "e_expert"], [f"e_{m}"], axis=0) for m in MATRICES]


def _quantized_matrices(bits: int) -> list[onnx.NodeProto]:
    """The same, gathered as integers and de-quantized (only this expert's): each block of values
    times its scale, as a ``Cast`` and a broadcast ``Mul`` (three times faster in ONNX Runtime
    than a blocked ``DequantizeLinear``, which it runs unvectorised)."""
    node = helper.make_node
    nodes = [_ints("e_one_more_axis", [-1])]
    if bits == 4:
        byte = lambda name, v: node("Constant", [], [name], value=helper.make_tensor(  # noqa: E731
            name, TensorProto.UINT8, [], [v]))
        eight = helper.make_tensor("e_eight", TensorProto.FLOAT, [], [8.0])
        nodes += [byte("e_low_mask", 15), byte("e_four", 4), _ints("e_rows_by_columns", [0, -1]),
                  node("Constant", [], ["e_eight"], value=eight)]
    for m in MATRICES:
        q, scales, ints = f"e_{m}_q", f"e_{m}_scales", f"e_{m}_ints"
        nodes += [node("Gather", [f"{m}_q", "e_expert"], [q], axis=0),             # [N, K] or [N, K/2]
                  node("Gather", [f"{m}_scales", "e_expert"], [scales], axis=0)]   # [N, K/block]
        if bits == 8:
            nodes.append(node("CastLike", [q, scales], [ints]))
        else:   # [N, K/2] bytes -> [N, K/2, 2] nibbles -> [N, K], less 8
            nodes += [
                node("BitwiseAnd", [q, "e_low_mask"], [f"{q}_low"]),
                node("BitShift", [q, "e_four"], [f"{q}_high"], direction="RIGHT"),
                node("Unsqueeze", [f"{q}_low", "e_last"], [f"{q}_low_3d"]),
                node("Unsqueeze", [f"{q}_high", "e_last"], [f"{q}_high_3d"]),
                node("Concat", [f"{q}_low_3d", f"{q}_high_3d"], [f"{q}_pairs"], axis=-1),
                node("Reshape", [f"{q}_pairs", "e_rows_by_columns"], [f"{q}_unsigned"]),
                node("CastLike", [f"{q}_unsigned", scales], [f"{q}_shifted"]),
                node("CastLike", ["e_eight", scales], [f"{q}_eight"]),
                node("Sub", [f"{q}_shifted", f"{q}_eight"], [ints]),
            ]
        nodes += [  # [N, K] -> [N, K/block, block] times [N, K/block, 1] -> [N, K]
            node("Shape", [scales], [f"{scales}_shape"]),
            node("Concat", [f"{scales}_shape", "e_one_more_axis"], [f"{ints}_blocked_shape"], axis=0),
            node("Reshape", [ints, f"{ints}_blocked_shape"], [f"{ints}_blocked"]),
            node("Unsqueeze", [scales, "e_one_more_axis"], [f"{scales}_3d"]),
            node("Mul", [f"{ints}_blocked", f"{scales}_3d"], [f"e_{m}_blocked"]),
            node("Shape", [ints], [f"{ints}_shape"]),
            node("Reshape", [f"e_{m}_blocked", f"{ints}_shape"], [f"e_{m}"]),
        ]
    return nodes


def _expert_body(matrices: list[onnx.NodeProto]) -> onnx.GraphProto:
    """Iteration ``i``: expert ``selected[i]``'s tokens through its SwiGLU, weighted, added to
    ``acc [T, H]``; ``matrices`` give the expert's ``e_gate_up`` and ``e_down``."""
    node = helper.make_node
    nodes = [
        _ints("e_axis1", [1]), _ints("e_last", [-1]), _ints("e_first", [0]),
        node("Gather", ["selected", "i"], ["e_expert"], axis=0),               # a scalar id
        node("Equal", ["experts", "e_expert"], ["e_hit"]),                    # [T, k]
        node("Cast", ["e_hit"], ["e_hit_float"], to=TensorProto.FLOAT),
        node("ReduceMax", ["e_hit_float", "e_axis1"], ["e_routed"], keepdims=0),   # [T]
        node("NonZero", ["e_routed"], ["e_rows_2d"]),                         # [1, n]
        node("Squeeze", ["e_rows_2d", "e_first"], ["e_rows"]),
        node("CastLike", ["e_hit", "weights"], ["e_hit_weights"]),
        node("Mul", ["weights", "e_hit_weights"], ["e_weights_kept"]),
        node("ReduceSum", ["e_weights_kept", "e_axis1"], ["e_weight"], keepdims=0),  # [T]
        node("Gather", ["x", "e_rows"], ["e_x"], axis=0),                     # [n, H]
        *matrices,                                                            # [2I, H], [H, I]
        node("Gemm", ["e_x", "e_gate_up"], ["e_h"], transB=1),
        node("Split", ["e_h"], ["e_gate", "e_up"], axis=-1, num_outputs=2),
        node("Sigmoid", ["e_gate"], ["e_sigmoid"]),
        node("Mul", ["e_gate", "e_sigmoid"], ["e_silu"]),
        node("Mul", ["e_silu", "e_up"], ["e_a"]),
        node("Gemm", ["e_a", "e_down"], ["e_y"], transB=1),                   # [n, H]
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


def _function(name: str, inputs: list[str], matrices: list[onnx.NodeProto]) -> onnx.FunctionProto:
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
        node("Loop", ["count", "true", "acc0"], ["out"], body=_expert_body(matrices)),
    ]
    return helper.make_function(DOMAIN, name, inputs, OUTPUTS, nodes, [helper.make_opsetid("", 23)])


class MoeExperts:
    """What the exporter attaches for each ``dspark`` node type: its name and function proto."""
    name = NAME

    @staticmethod
    def to_function_proto() -> onnx.FunctionProto:
        return _function(NAME, INPUTS, _float_matrices())


def quantized_function(bits: int) -> onnx.FunctionProto:
    """``MoeExpertsInt{bits}``'s function proto."""
    return _function(f"{NAME}Int{bits}", QUANTIZED_INPUTS, _quantized_matrices(bits))


def translate(x, experts, weights, gate_up, down):
    """``torch.ops.dspark.moe_experts`` -> one ``dspark::MoeExperts`` node."""
    return dspark.MoeExperts(x, experts, weights, gate_up, down, **PLUGIN_ATTRIBUTES)
