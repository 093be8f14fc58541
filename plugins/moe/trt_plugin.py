"""``dspark::MoeExperts`` as a TensorRT plugin: inputs ``x [T, H], experts [T, k]`` (int64),
``weights [T, k], gate_up [E, 2I, H], down [E, H, I]``, attribute ``activation``; output
``out [T, H]``. TensorRT has no ``Unique``, and its ``Loop`` could not skip the experts nobody
chose: the Triton kernel reads only those, its pair lists and rows in the plugin's workspace.
``MoeExpertsInt8`` / ``Int4`` take each matrix as integers and block scales instead (``x, experts,
weights, gate_up_q, gate_up_scales, down_q, down_scales``), which the kernel de-quantizes tile by
tile."""
from __future__ import annotations

from functools import partial

from ..trt_plugin_spec import PluginSpec, device_tensors, on_stream, workspace_floats


def _output_types(trt, input_types):
    return [input_types[0]]


def _output_shapes(trt, inputs, builder):
    return [inputs[0]]


def _supports(bits: int, trt, pos, in_out, num_inputs):
    kind = in_out[pos].desc.type
    if pos == 1:                                          # experts
        return kind == trt.DataType.INT64
    if bits and pos in (3, 5):                            # the integers (int4: two to an int8)
        return kind == trt.DataType.INT8
    floats = (trt.DataType.FLOAT, trt.DataType.HALF, trt.DataType.BF16)
    return kind in floats and kind == in_out[0].desc.type


def _sizes(bits: int, shape_of) -> tuple[int, ...]:
    """``triton_kernel.sizes`` from the inputs' shapes, in the node's input order."""
    from .triton_kernel import sizes

    if bits:   # x, experts, weights, gate_up_q, gate_up_scales, down_q, down_scales
        return sizes(shape_of(0), shape_of(1), shape_of(3), shape_of(5), shape_of(4), shape_of(6))
    return sizes(shape_of(0), shape_of(1), shape_of(3), shape_of(4))


def _workspace(bits: int, inputs) -> int:
    from .triton_kernel import workspace_bytes

    return workspace_bytes(*_sizes(bits, lambda i: tuple(inputs[i].max)))


def _enqueue(bits: int, trt, attrs, input_desc, output_desc, inputs, outputs, workspace, stream):
    from .triton_kernel import moe_experts, workspace_bytes

    tensors = device_tensors(trt, inputs, input_desc)
    (out,) = device_tensors(trt, outputs, output_desc)
    needed = workspace_bytes(*_sizes(bits, lambda i: tuple(tensors[i].shape)))
    if bits:
        x, experts, weights, gate_up, gate_up_scales, down, down_scales = tensors
        matrices = dict(gate_up_scales=gate_up_scales, down_scales=down_scales, bits=bits)
    else:
        (x, experts, weights, gate_up, down), matrices = tensors, {}
    with on_stream(stream):
        moe_experts(x, experts, weights, gate_up, down, out, workspace_floats(workspace, needed),
                    activation=int(attrs["activation"]), **matrices)


def _spec(bits: int) -> PluginSpec:
    return PluginSpec(name=f"MoeExpertsInt{bits}" if bits else "MoeExperts", num_outputs=1,
                      fields={"activation": "int"}, output_types=_output_types, output_shapes=_output_shapes,
                      supports=partial(_supports, bits), enqueue=partial(_enqueue, bits),
                      workspace=partial(_workspace, bits))


SPEC, INT8_SPEC, INT4_SPEC = _spec(0), _spec(8), _spec(4)
