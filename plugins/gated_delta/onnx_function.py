"""``dspark::GatedDeltaRule`` in ONNX: schema, the standard-op function body that ONNX Runtime
runs (and TensorRT inlines when no plugin is registered), and the exporter's translation.

The body is a ``Scan`` over the rows, which onnxscript cannot write (it has no scan outputs), so
it is built with ``onnx.helper``: the state is carried, each row's output is a scan output, and the
slots' states are kept one of two ways (``_branch``), chosen by the row count.
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


def _value(name: str, kind: int, rank: int):
    return helper.make_tensor_value_info(name, kind, [None] * rank)


F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def _row_body(capture: bool) -> onnx.GraphProto:
    """One row, its products read off the state once: with ``d = exp(g)``,
    ``[q; k]^T s`` by one ``MatMul``, then ``delta = (v - d k^T s) beta``,
    ``s' = d s + k delta^T`` and ``out = d q^T s + (q . k) delta`` (= ``s'^T q``).

    Carried: ``s [B, H, Dk, Dv]``, ``rows [B, R]`` and, with ``capture``, the captured slots
    ``[B, R, H, Dk, Dv]`` (a slot takes ``s'`` at its row); otherwise ``s'`` is also a scan output.
    Scanned: ``q_i, k_i [B, H, Dk]``, ``v_i [B, H, Dv]``, ``g_i, beta_i [B, H]``, ``i []``."""
    node = helper.make_node
    nodes = [
        _ints("r_last", [-1]), _ints("r_row", [2]), _ints("r_pair", [2, 3]), _ints("r_zero", [0]),
        _ints("r_one", [1]), _ints("r_two", [2]),
        node("Exp", ["g_i"], ["r_decay"]),
        node("Unsqueeze", ["r_decay", "r_last"], ["r_decay_3d"]),
        node("Unsqueeze", ["r_decay", "r_pair"], ["r_decay_4d"]),
        node("Unsqueeze", ["q_i", "r_row"], ["r_q_row"]),
        node("Unsqueeze", ["k_i", "r_row"], ["r_k_row"]),
        node("Concat", ["r_q_row", "r_k_row"], ["r_qk"], axis=2),
        node("MatMul", ["r_qk", "s"], ["r_read"]),                          # [B, H, 2, Dv]
        node("Slice", ["r_read", "r_zero", "r_one", "r_row"], ["r_q_read_3"]),
        node("Slice", ["r_read", "r_one", "r_two", "r_row"], ["r_k_read_3"]),
        node("Squeeze", ["r_q_read_3", "r_row"], ["r_q_read"]),
        node("Squeeze", ["r_k_read_3", "r_row"], ["r_k_read"]),
        node("Mul", ["r_k_read", "r_decay_3d"], ["r_remembered"]),
        node("Sub", ["v_i", "r_remembered"], ["r_error"]),
        node("Unsqueeze", ["beta_i", "r_last"], ["r_beta"]),
        node("Mul", ["r_error", "r_beta"], ["r_delta"]),
        node("Unsqueeze", ["k_i", "r_last"], ["r_k_col"]),
        node("Unsqueeze", ["r_delta", "r_row"], ["r_delta_row"]),
        node("MatMul", ["r_k_col", "r_delta_row"], ["r_write"]),            # k delta^T
        node("Mul", ["s", "r_decay_4d"], ["r_decayed"]),
        node("Add", ["r_decayed", "r_write"], ["s_next"]),
        node("Mul", ["q_i", "k_i"], ["r_qk_terms"]),
        node("ReduceSum", ["r_qk_terms", "r_last"], ["r_q_dot_k"], keepdims=1),
        node("Mul", ["r_q_read", "r_decay_3d"], ["r_q_decayed"]),
        node("Mul", ["r_q_dot_k", "r_delta"], ["r_q_written"]),
        node("Add", ["r_q_decayed", "r_q_written"], ["out_i"]),
        node("Identity", ["rows"], ["rows_next"]),
    ]
    inputs = [_value("s", F32, 4), _value("rows", I64, 2)]
    outputs = [_value("s_next", F32, 4), _value("rows_next", I64, 2)]
    if capture:
        nodes += [
            node("Equal", ["rows", "i"], ["r_hit"]),
            _ints("r_state_axes", [2, 3, 4]),
            node("Unsqueeze", ["r_hit", "r_state_axes"], ["r_hit_5d"]),
            node("Unsqueeze", ["s_next", "r_one"], ["r_s_5d"]),
            node("Where", ["r_hit_5d", "r_s_5d", "captured"], ["captured_next"]),
        ]
        inputs.insert(1, _value("captured", F32, 5))
        outputs.insert(1, _value("captured_next", F32, 5))
    else:
        nodes.append(node("Identity", ["s_next"], ["s_scanned"]))
    inputs += [_value(n, F32, r) for n, r in (("q_i", 3), ("k_i", 3), ("v_i", 3), ("g_i", 2), ("beta_i", 2))]
    inputs.append(_value("i", I64, 0))
    outputs.append(_value("out_i", F32, 3))
    if not capture:
        outputs.append(_value("s_scanned", F32, 4))
    return helper.make_graph(nodes, f"gated_delta_row{'_captured' if capture else ''}", inputs, outputs)


def _branch(capture: bool) -> onnx.GraphProto:
    """The rows' scan, keeping the slots' states: few rows (at most the bank's slots, a verify
    step) scan every row's state out and pick the slots' from them, one write each; a long prefill
    chunk carries the captured slots instead, a slot-sized select per row and no state per row."""
    node = helper.make_node
    scanned = ["q_grouped", "k_grouped", "v", "g", "beta", "row_index"]
    prefix = "c_" if capture else "p_"
    if capture:
        nodes = [node("Scan", ["s0", "captured0", "state_rows", *scanned],
                      [f"{prefix}s_last", f"{prefix}captured", f"{prefix}rows_last", f"{prefix}out"],
                      num_scan_inputs=6, scan_input_axes=[1, 1, 1, 1, 1, 0], scan_output_axes=[1],
                      body=_row_body(capture=True))]
    else:
        nodes = [
            node("Scan", ["s0", "state_rows", *scanned],
                 [f"{prefix}s_last", f"{prefix}rows_last", f"{prefix}out", f"{prefix}states"],
                 num_scan_inputs=6, scan_input_axes=[1, 1, 1, 1, 1, 0], scan_output_axes=[1, 1],
                 body=_row_body(capture=False)),
            node("Concat", ["s0_5d", f"{prefix}states"], [f"{prefix}with_start"], axis=1),
            _ints(f"{prefix}one", [1]), _ints(f"{prefix}last", [-1]),
            node("Add", ["state_rows", f"{prefix}one"], [f"{prefix}picks"]),    # -1: the start
            node("Unsqueeze", [f"{prefix}picks", f"{prefix}last"], [f"{prefix}pick_index"]),
            node("GatherND", [f"{prefix}with_start", f"{prefix}pick_index"], [f"{prefix}captured"],
                 batch_dims=1),
        ]
    return helper.make_graph(nodes, f"gated_delta_{'capture' if capture else 'pick'}", [],
                             [_value(f"{prefix}out", F32, 4), _value(f"{prefix}captured", F32, 5)])


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
        node("Shape", ["state"], ["slot_count"], start=1, end=2),
        node("LessOrEqual", ["row_count", "slot_count"], ["few_rows_1"]),
        node("Squeeze", ["few_rows_1"], ["few_rows"]),
        node("If", ["few_rows"], ["out", "captured"], then_branch=_branch(capture=False),
             else_branch=_branch(capture=True)),
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
