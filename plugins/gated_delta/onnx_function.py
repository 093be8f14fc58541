"""``dspark::GatedDeltaRule`` in ONNX: schema, the standard-op function body that ONNX Runtime
runs (and TensorRT inlines when no plugin is registered), and the exporter's translation.

The body is a ``Scan`` over the rows, which onnxscript cannot write (it has no scan outputs), so
it is built with ``onnx.helper``. The carried values are the state and the captured slots
``[B, R, H, Dk, Dv]``; each row's output is a scan output.
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper
from onnxscript.values import Opset

from ..onnx_domain import DOMAIN, DOMAIN_VERSION, PLUGIN_ATTRIBUTES, register_schema

NAME = "GatedDeltaRule"
INPUTS = ["q", "k", "v", "g", "beta", "state", "slot", "state_rows"]
OUTPUTS = ["out", "state_out"]

register_schema(
    NAME,
    inputs=[(n, "tensor(int64)" if n in ("slot", "state_rows") else "tensor(float)") for n in INPUTS],
    outputs=[(n, "tensor(float)") for n in OUTPUTS],
    type_constraints=[],
    attributes=[],
    doc="The gated delta rule over a bank of state slots: start from state[b, slot[b]], write the "
        "states after rows state_rows[b, j] into slots j; see plugins/gated_delta/reference.py.",
)
dspark = Opset(DOMAIN, DOMAIN_VERSION)


def _ints(name: str, values: list[int]):
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(
        name, TensorProto.INT64, [len(values)], values))


def _row_body() -> onnx.GraphProto:
    """One row: ``s [B, H, Dk, Dv]``, ``captured [B, R, H, Dk, Dv]``, ``rows [B, R]`` carried;
    ``q_i, k_i [B, H, Dk]``, ``v_i [B, H, Dv]``, ``g_i, beta_i [B, H]``, ``i []`` scanned."""
    node = helper.make_node
    nodes = [
        _ints("last", [-1]), _ints("next_to_last", [-2]), _ints("last_two", [-2, -1]),
        _ints("slot_axis", [1]),
        node("Exp", ["g_i"], ["decay"]),
        node("Unsqueeze", ["decay", "last_two"], ["decay_4d"]),
        node("Mul", ["s", "decay_4d"], ["s_decayed"]),
        node("Unsqueeze", ["k_i", "last"], ["k_col"]),
        node("Mul", ["s_decayed", "k_col"], ["s_k"]),
        node("ReduceSum", ["s_k", "next_to_last"], ["remembered"], keepdims=0),
        node("Sub", ["v_i", "remembered"], ["error"]),
        node("Unsqueeze", ["beta_i", "last"], ["beta_col"]),
        node("Mul", ["error", "beta_col"], ["delta"]),
        node("Unsqueeze", ["delta", "next_to_last"], ["delta_row"]),
        node("Mul", ["k_col", "delta_row"], ["write"]),
        node("Add", ["s_decayed", "write"], ["s_next"]),
        node("Unsqueeze", ["q_i", "last"], ["q_col"]),
        node("Mul", ["s_next", "q_col"], ["s_q"]),
        node("ReduceSum", ["s_q", "next_to_last"], ["out_i"], keepdims=0),
        node("Equal", ["rows", "i"], ["hit"]),
        _ints("state_axes", [2, 3, 4]),
        node("Unsqueeze", ["hit", "state_axes"], ["hit_5d"]),
        node("Unsqueeze", ["s_next", "slot_axis"], ["s_5d"]),
        node("Where", ["hit_5d", "s_5d", "captured"], ["captured_next"]),
        node("Identity", ["rows"], ["rows_next"]),
    ]
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    def value(name, kind, rank):
        return helper.make_tensor_value_info(name, kind, [None] * rank)

    inputs = [value(n, t, r) for n, t, r in (
        ("s", f, 4), ("captured", f, 5), ("rows", i64, 2), ("q_i", f, 3), ("k_i", f, 3), ("v_i", f, 3),
        ("g_i", f, 2), ("beta_i", f, 2), ("i", i64, 0))]
    outputs = [value(n, t, r) for n, t, r in (
        ("s_next", f, 4), ("captured_next", f, 5), ("rows_next", i64, 2), ("out_i", f, 3))]
    return helper.make_graph(nodes, "gated_delta_row", inputs, outputs)


def _function() -> onnx.FunctionProto:
    node = helper.make_node
    nodes = [
        _ints("zero", [0]), _ints("one", [1]), _ints("two", [2]), _ints("three", [3]),
        _ints("far", [1 << 62]), _ints("ones3", [1, 1, 1]), _ints("keep2", [0, 0]),
        _ints("infer", [-1]), _ints("scan_start", [0]),
        # each key head serves H / Hk consecutive value heads: [B, S, Hk, Dk] -> [B, S, H, Dk]
        node("Shape", ["v"], ["v_shape"]), node("Shape", ["k"], ["k_shape"]),
        node("Slice", ["v_shape", "two", "three"], ["heads"]),
        node("Slice", ["k_shape", "two", "three"], ["key_heads"]),
        node("Div", ["heads", "key_heads"], ["group"]),
        node("Concat", ["ones3", "group", "one"], ["group_shape"], axis=0),
        node("Concat", ["keep2", "heads", "infer"], ["grouped_shape"], axis=0),
    ]
    for name in ("q", "k"):
        nodes += [node("Unsqueeze", [name, "three"], [f"{name}_5d"]),
                  node("Expand", [f"{name}_5d", "group_shape"], [f"{name}_expanded"]),
                  node("Reshape", [f"{name}_expanded", "grouped_shape"], [f"{name}_grouped"])]
    nodes += [
        # the starting state, and the captured slots, all of it until a row replaces it
        node("Unsqueeze", ["slot", "one"], ["slot_index"]),
        node("GatherND", ["state", "slot_index"], ["s0"], batch_dims=1),
        node("Unsqueeze", ["s0", "one"], ["s0_5d"]),
        node("Shape", ["state_rows"], ["captured_count"], start=1, end=2),
        node("Concat", ["one", "captured_count", "ones3"], ["captured_shape"], axis=0),
        node("Expand", ["s0_5d", "captured_shape"], ["captured0"]),
        node("Shape", ["v"], ["row_count"], start=1, end=2),
        node("Squeeze", ["row_count"], ["row_scalar"]),
        node("Squeeze", ["scan_start"], ["zero_scalar"]),
        node("Squeeze", ["one"], ["one_scalar"]),
        node("Range", ["zero_scalar", "row_scalar", "one_scalar"], ["row_index"]),
        node("Scan", ["s0", "captured0", "state_rows", "q_grouped", "k_grouped", "v", "g", "beta",
                      "row_index"], ["s_last", "captured", "rows_last", "out"],
             num_scan_inputs=6, scan_input_axes=[1, 1, 1, 1, 1, 0], scan_output_axes=[1],
             body=_row_body()),
        node("Slice", ["state", "captured_count", "far", "one"], ["kept"]),
        node("Concat", ["captured", "kept"], ["state_out"], axis=1),
    ]
    return helper.make_function(DOMAIN, NAME, INPUTS, OUTPUTS, nodes,
                                [helper.make_opsetid("", 23)])


class GatedDeltaRule:
    """What the exporter attaches for each ``dspark`` node type: its name and function proto."""
    name = NAME

    @staticmethod
    def to_function_proto() -> onnx.FunctionProto:
        return _function()


def translate(q, k, v, g, beta, state, slot, state_rows):
    """``torch.ops.dspark.gated_delta_rule`` -> one ``dspark::GatedDeltaRule`` node."""
    return dspark.GatedDeltaRule(q, k, v, g, beta, state, slot, state_rows, _outputs=2,
                                 **PLUGIN_ATTRIBUTES)
