"""``dspark::MoeExperts`` in ONNX: schema, the standard-op function body that ONNX Runtime runs,
and the exporter's translation. The body is a ``Loop`` over ``Unique(experts)`` (ascending), built
with ``onnx.helper`` (onnxscript writes no loops over computed trip counts with scatter updates):
per expert, ``NonZero`` finds its tokens, ``Gather`` takes them and the expert's two matrices,
two ``Gemm(transB=1)`` apply them as stored, and ``ScatterND`` writes its rows of the carried
output with the weighted rows added (ONNX Runtime has no fp16 ``reduction="add"`` on the CPU)."""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper
from onnxscript.values import Opset

from ..onnx_domain import DOMAIN, DOMAIN_VERSION, FLOAT_TYPES, PLUGIN_ATTRIBUTES, register_schema

NAME = "MoeExperts"
INPUTS = ["x", "experts", "weights", "gate_up", "down"]
OUTPUTS = ["out"]

register_schema(
    NAME,
    inputs=[("x", "T"), ("experts", "tensor(int64)"), ("weights", "T"), ("gate_up", "T"), ("down", "T")],
    outputs=[("out", "T")],
    type_constraints=[("T", FLOAT_TYPES, "activation and weight type")],
    attributes=[],
    doc="The routed experts of a MoE layer, only those selected: out_t = sum_j weights[t, j] * "
        "down[e] @ (silu(gate) * up), gate, up = split(gate_up[e] @ x_t), e = experts[t, j]; see "
        "plugins/moe/reference.py.",
)
dspark = Opset(DOMAIN, DOMAIN_VERSION)


def _ints(name: str, values: list[int]):
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(
        name, TensorProto.INT64, [len(values)], values))


def _expert_body() -> onnx.GraphProto:
    """Iteration ``i``: expert ``selected[i]``'s tokens through its SwiGLU, weighted, added to
    ``acc [T, H]``."""
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
        node("Gather", ["gate_up", "e_expert"], ["e_gate_up"], axis=0),       # [2I, H]
        node("Gather", ["down", "e_expert"], ["e_down"], axis=0),             # [H, I]
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


def _function() -> onnx.FunctionProto:
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
        node("Loop", ["count", "true", "acc0"], ["out"], body=_expert_body()),
    ]
    return helper.make_function(DOMAIN, NAME, INPUTS, OUTPUTS, nodes, [helper.make_opsetid("", 23)])


class MoeExperts:
    """What the exporter attaches for each ``dspark`` node type: its name and function proto."""
    name = NAME

    @staticmethod
    def to_function_proto() -> onnx.FunctionProto:
        return _function()


def translate(x, experts, weights, gate_up, down):
    """``torch.ops.dspark.moe_experts`` -> one ``dspark::MoeExperts`` node."""
    return dspark.MoeExperts(x, experts, weights, gate_up, down, **PLUGIN_ATTRIBUTES)
