"""``dspark::BlockAttention`` as a TensorRT plugin: inputs ``q, k_new, v_new, k_cache, v_cache,
start``; outputs ``out, k_cache_out, v_cache_out``, each cache output declared an alias of its cache
input, so the write is in place; were the buffers distinct all the same, the cache would be copied
first."""
from __future__ import annotations

from ..trt_plugin_spec import PluginSpec, device_tensors, on_stream, workspace_floats


def _output_types(trt, input_types):
    return [input_types[0], input_types[3], input_types[4]]


def _output_shapes(trt, inputs, builder):
    return [inputs[0], inputs[3], inputs[4]]


def _supports(trt, pos, in_out, num_inputs):
    kind = in_out[pos].desc.type
    if pos == 5:                                          # start
        return kind == trt.DataType.INT64
    floats = (trt.DataType.FLOAT, trt.DataType.HALF, trt.DataType.BF16)
    return kind in floats and kind == in_out[0].desc.type


def _workspace(inputs) -> int:
    from .triton_kernel import workspace_bound

    return workspace_bound(head_dim=inputs[0].max[3])


def _enqueue(trt, attrs, input_desc, output_desc, inputs, outputs, workspace, stream):
    from .triton_kernel import block_attention, workspace_bound

    q, k_new, v_new, k_in, v_in, start = device_tensors(trt, inputs, input_desc)
    out, k_cache, v_cache = device_tensors(trt, outputs, output_desc)
    with on_stream(stream):
        for source, cache in ((k_in, k_cache), (v_in, v_cache)):
            if source.data_ptr() != cache.data_ptr():
                cache.copy_(source)
        block_attention(q, k_new, v_new, k_cache, v_cache, start, out,
                        causal=bool(attrs["causal"]), scale=attrs["scale"], window=attrs["window"],
                        workspace=workspace_floats(workspace, workspace_bound(q.shape[3])))


SPEC = PluginSpec(name="BlockAttention", num_outputs=3,
                  fields={"causal": "int", "scale": "float", "window": "int"},
                  output_types=_output_types, output_shapes=_output_shapes, supports=_supports,
                  enqueue=_enqueue, aliases={1: 3, 2: 4}, workspace=_workspace)
