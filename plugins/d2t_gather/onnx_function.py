"""``dspark::D2TGather`` in ONNX: schema, standard-op function body, exporter translation."""
from __future__ import annotations

import onnxscript
from onnxscript import opset23 as op
from onnxscript.values import Opset

from ..onnx_domain import DOMAIN, DOMAIN_VERSION, FLOAT_TYPES, PLUGIN_ATTRIBUTES, register_schema
from . import NAME

register_schema(
    NAME,
    inputs=[("scores", "T"), ("d2t", "tensor(int64)"), ("markov_w1", "W")],
    outputs=[("target_ids", "tensor(int64)"), ("markov_rows", "W")],
    type_constraints=[("T", FLOAT_TYPES, "score type"), ("W", FLOAT_TYPES, "weight type")],
    attributes=[],
    doc="argmax of scores (Gumbel noise already added), target id = id + d2t[id], and the Markov "
        "row markov_w1[target id]; see plugins/d2t_gather/reference.py.",
)
dspark = Opset(DOMAIN, DOMAIN_VERSION)


@onnxscript.script(dspark, default_opset=op)
def D2TGather(scores, d2t, markov_w1):
    draft_ids = op.ArgMax(scores, axis=-1, keepdims=0)
    target_ids = draft_ids + op.Gather(d2t, draft_ids, axis=0)
    return target_ids, op.Gather(markov_w1, target_ids, axis=0)


def translate(scores, d2t, markov_w1):
    """``torch.ops.dspark.d2t_gather`` -> one ``dspark::D2TGather`` node."""
    return dspark.D2TGather(scores, d2t, markov_w1, _outputs=2, **PLUGIN_ATTRIBUTES)
