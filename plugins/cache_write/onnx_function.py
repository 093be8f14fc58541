"""``dspark::CacheWrite`` in ONNX: schema, the standard-op function body that ONNX Runtime runs
(and TensorRT inlines when no plugin is registered), and the exporter's translation."""
from __future__ import annotations

import onnxscript
from onnxscript import opset23 as op
from onnxscript.values import Opset

from ..onnx_domain import DOMAIN, DOMAIN_VERSION, FLOAT_TYPES, PLUGIN_ATTRIBUTES, register_schema
from . import NAME

register_schema(
    NAME,
    inputs=[("cache", "T"), ("new", "T"), ("start", "tensor(int64)")],
    outputs=[("cache_out", "T")],
    type_constraints=[("T", FLOAT_TYPES, "cache type")],
    attributes=[],
    doc="Write a block of K or V rows into a fixed-capacity cache at each row's start; see "
        "plugins/cache_write/reference.py.",
)
dspark = Opset(DOMAIN, DOMAIN_VERSION)


@onnxscript.script(dspark, default_opset=op)
def CacheWrite(cache, new, start):
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    rows = op.Squeeze(op.Shape(new, start=2, end=3))
    write = op.Unsqueeze(start, [1]) + op.Unsqueeze(op.Range(zero, rows, one), [0])
    index = op.Expand(op.Unsqueeze(write, [1, 3]), op.Shape(new))
    return op.ScatterElements(cache, index, new, axis=2)


def translate(cache, new, start):
    """``torch.ops.dspark.cache_write`` -> one ``dspark::CacheWrite`` node."""
    return dspark.CacheWrite(cache, new, start, **PLUGIN_ATTRIBUTES)
