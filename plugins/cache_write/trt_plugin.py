"""``dspark::CacheWrite`` as a TensorRT plugin: inputs ``cache, new, start``; output ``cache_out``,
declared an alias of ``cache``, so the rows are written in place; were the buffers distinct all the
same, the cache would be copied first."""
from __future__ import annotations

from ..trt_plugin_spec import PluginSpec, device_tensors, on_stream


def _output_types(trt, input_types):
    return [input_types[0]]


def _output_shapes(trt, inputs, builder):
    return [inputs[0]]


def _supports(trt, pos, in_out, num_inputs):
    kind = in_out[pos].desc.type
    if pos == 2:                                          # start
        return kind == trt.DataType.INT64
    floats = (trt.DataType.FLOAT, trt.DataType.HALF, trt.DataType.BF16)
    return kind in floats and kind == in_out[0].desc.type


def _enqueue(trt, attrs, input_desc, output_desc, inputs, outputs, workspace, stream):
    from .triton_kernel import write_rows

    source, new, start = device_tensors(trt, inputs, input_desc)
    (cache,) = device_tensors(trt, outputs, output_desc)
    with on_stream(stream):
        if source.data_ptr() != cache.data_ptr():
            cache.copy_(source)
        write_rows(new, cache, start)


SPEC = PluginSpec(name="CacheWrite", num_outputs=1, fields={}, output_types=_output_types,
                  output_shapes=_output_shapes, supports=_supports, enqueue=_enqueue, aliases={0: 0})
