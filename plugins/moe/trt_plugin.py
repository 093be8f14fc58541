"""``dspark::MoeExperts`` as a TensorRT plugin: inputs ``x [T, H], experts [T, k]`` (int64),
``weights [T, k], gate_up [E, 2I, H], down [E, H, I]``; output ``out [T, H]``. TensorRT has no
``Unique``, and its ``Loop`` could not skip the experts nobody chose: the Triton kernel reads only
those, its pair lists and rows in the plugin's workspace."""
from __future__ import annotations

from ..tensorrt_plugin import PluginSpec, device_tensors, on_stream, workspace_floats


def _output_types(trt, input_types):
    return [input_types[0]]


def _output_shapes(trt, inputs, builder):
    return [inputs[0]]


def _supports(trt, pos, in_out, num_inputs):
    kind = in_out[pos].desc.type
    if pos == 1:                                          # experts
        return kind == trt.DataType.INT64
    floats = (trt.DataType.FLOAT, trt.DataType.HALF, trt.DataType.BF16)
    return kind in floats and kind == in_out[0].desc.type


def _sizes(shape_of) -> tuple[int, int, int, int, int]:
    """``(tokens, k, experts, hidden, intermediate)`` from the inputs' shapes."""
    (tokens, hidden), top_k = shape_of(0), shape_of(1)[1]
    return tokens, top_k, shape_of(3)[0], hidden, shape_of(4)[2]


def _workspace(inputs) -> int:
    from .triton_kernel import workspace_bytes

    return workspace_bytes(*_sizes(lambda i: tuple(inputs[i].max)))


def _enqueue(trt, attrs, input_desc, output_desc, inputs, outputs, workspace, stream):
    from .triton_kernel import moe_experts, workspace_bytes

    x, experts, weights, gate_up, down = tensors = device_tensors(trt, inputs, input_desc)
    (out,) = device_tensors(trt, outputs, output_desc)
    scratch = workspace_floats(workspace, workspace_bytes(*_sizes(lambda i: tuple(tensors[i].shape))))
    with on_stream(stream):
        moe_experts(x, experts, weights, gate_up, down, out, scratch)


SPEC = PluginSpec(name="MoeExperts", num_outputs=1, fields={}, output_types=_output_types,
                  output_shapes=_output_shapes, supports=_supports, enqueue=_enqueue,
                  workspace=_workspace)
