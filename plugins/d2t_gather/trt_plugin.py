"""``dspark::D2TGather`` as a TensorRT plugin: inputs ``scores [B, V_d], d2t [V_d], markov_w1
[V, r]``; outputs ``target_ids [B]`` (int64) and ``markov_rows [B, r]``."""
from __future__ import annotations

from ..trt_plugin_spec import PluginSpec, device_tensors, on_stream


def _output_types(trt, input_types):
    return [trt.DataType.INT64, input_types[2]]


def _output_shapes(trt, inputs, builder):
    ids, rows = trt.DimsExprs(1), trt.DimsExprs(2)
    ids[0] = rows[0] = inputs[0][0]
    rows[1] = inputs[2][1]
    return [ids, rows]


def _supports(trt, pos, in_out, num_inputs):
    kind = in_out[pos].desc.type
    floats = (trt.DataType.FLOAT, trt.DataType.HALF, trt.DataType.BF16)
    if pos in (1, 3):                                     # d2t, target_ids
        return kind == trt.DataType.INT64
    if pos == 4:                                          # markov_rows: markov_w1's type
        return kind == in_out[2].desc.type
    return kind in floats


def _enqueue(trt, attrs, input_desc, output_desc, inputs, outputs, workspace, stream):
    from .triton_kernel import d2t_gather

    scores, d2t, markov_w1 = device_tensors(trt, inputs, input_desc)
    ids, rows = device_tensors(trt, outputs, output_desc)
    with on_stream(stream):
        d2t_gather(scores, d2t, markov_w1, ids, rows)


SPEC = PluginSpec(name="D2TGather", num_outputs=2, fields={}, output_types=_output_types,
                  output_shapes=_output_shapes, supports=_supports, enqueue=_enqueue)
