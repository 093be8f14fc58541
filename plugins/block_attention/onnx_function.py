"""``dspark::BlockAttention`` in ONNX: schema, the standard-op function body that ONNX Runtime
runs (and TensorRT inlines when no plugin is registered), and the exporter's translation."""
from __future__ import annotations

import onnxscript
from onnx.defs import OpSchema
from onnxscript import opset23 as op
from onnxscript.values import Opset

from ..onnx_domain import DOMAIN, DOMAIN_VERSION, FLOAT_TYPES, PLUGIN_ATTRIBUTES, register_schema
from . import NAME

register_schema(
    NAME,
    inputs=[("q", "T"), ("k_new", "T"), ("v_new", "T"), ("k_cache", "T"), ("v_cache", "T"),
            ("start", "tensor(int64)")],
    outputs=[("out", "T"), ("k_cache_out", "T"), ("v_cache_out", "T")],
    type_constraints=[("T", FLOAT_TYPES, "activation type")],
    attributes=[("causal", OpSchema.AttrType.INT), ("scale", OpSchema.AttrType.FLOAT),
                ("window", OpSchema.AttrType.INT)],
    doc="Write a block's K/V into a fixed-capacity cache (a ring, position p in row p mod C) at "
        "each row's start, then attend (causal, within a sliding window when window > 0, or over "
        "the whole block); see plugins/block_attention/reference.py.",
)
dspark = Opset(DOMAIN, DOMAIN_VERSION)


@onnxscript.script(dspark, default_opset=op)
def BlockAttention(q, k_new, v_new, k_cache, v_cache, start, causal: int, scale: float, window: int):
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    rows = op.Shape(q, start=2, end=3)
    capacity = op.Shape(k_cache, start=2, end=3)
    positions = op.Unsqueeze(start, [1]) + op.Unsqueeze(op.Range(zero, op.Squeeze(rows), one), [0])
    index = op.Expand(op.Unsqueeze(op.Mod(positions, capacity), [1, 3]), op.Shape(k_new))
    k_out = op.ScatterElements(k_cache, index, k_new, axis=2)
    v_out = op.ScatterElements(v_cache, index, v_new, axis=2)
    # attend over the cache rows written so far, not the whole capacity
    last = op.Unsqueeze(start, [1]) + rows - one                                   # [B, 1]
    used = op.Min(op.Unsqueeze(op.ReduceMax(last, keepdims=0), [0]) + one, capacity)
    axis_start, axis = op.Constant(value_ints=[0]), op.Constant(value_ints=[2])
    keys = op.Slice(k_out, axis_start, used, axis)
    values = op.Slice(v_out, axis_start, used, axis)
    # the position each row holds (reference.held_positions), against each query's bounds
    held = op.Unsqueeze(last - op.Mod(last - op.Range(zero, op.Squeeze(used), one), capacity), [1])
    is_causal = op.Cast(op.Constant(value_int=causal), to=9)  # BOOL
    newest = op.Where(is_causal, positions, last)                                  # [B, S]
    width = op.Constant(value_int=window)
    lowest = op.Where(op.Greater(width, zero), positions - width, op.Neg(one))    # exclusive
    visible = op.And(op.And(op.GreaterOrEqual(held, zero), op.LessOrEqual(held, op.Unsqueeze(newest, [2]))),
                     op.Greater(held, op.Unsqueeze(lowest, [2])))
    out = op.Attention(q, keys, values, op.Unsqueeze(visible, [1]), scale=scale)
    return out, k_out, v_out


def translate(q, k_new, v_new, k_cache, v_cache, start, causal: bool, scale: float, window: int = 0):
    """``torch.ops.dspark.block_attention`` -> one ``dspark::BlockAttention`` node."""
    return dspark.BlockAttention(q, k_new, v_new, k_cache, v_cache, start, causal=int(causal),
                                 scale=float(scale), window=int(window), _outputs=3, **PLUGIN_ATTRIBUTES)
