"""``dspark::GatedDeltaRule`` as a TensorRT plugin: inputs ``q, k, v, g, beta, state, slot,
state_rows``; outputs ``out, state_out``, the state declared an alias of its input, so the slots
are written in place; were the buffers distinct all the same, the state would be copied first."""
from __future__ import annotations

from ..trt_plugin_spec import PluginSpec, device_tensors, on_stream


def _output_types(trt, input_types):
    return [input_types[2], input_types[5]]


def _output_shapes(trt, inputs, builder):
    return [inputs[2], inputs[5]]


def _supports(trt, pos, in_out, num_inputs):
    kind = in_out[pos].desc.type
    if pos in (6, 7):                                     # slot, state_rows
        return kind == trt.DataType.INT64
    return kind == trt.DataType.FLOAT


def _enqueue(trt, attrs, input_desc, output_desc, inputs, outputs, workspace, stream):
    from .triton_kernel import gated_delta_rule

    q, k, v, g, beta, source, slot, state_rows = device_tensors(trt, inputs, input_desc)
    out, state = device_tensors(trt, outputs, output_desc)
    with on_stream(stream):
        if source.data_ptr() != state.data_ptr():
            state.copy_(source)
        gated_delta_rule(q, k, v, g, beta, state, slot, state_rows, out)


SPEC = PluginSpec(name="GatedDeltaRule", num_outputs=2, fields={}, output_types=_output_types,
                  output_shapes=_output_shapes, supports=_supports, enqueue=_enqueue, aliases={1: 5})
