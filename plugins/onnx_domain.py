"""What every ``dspark`` ONNX operator shares: the domain, the plugin identity TensorRT matches on,
and schema registration.

TensorRT's ONNX parser imports a ``dspark`` node as our plugin only when a creator with exactly
the node's op type, ``plugin_version`` and ``plugin_namespace`` is registered, and otherwise
*silently* inlines the node's function body, so the attributes are set on every node and the
builder must check that plugin layers are present
(``docs/dspark.md#custom-ops-and-their-function-bodies``).
"""
from __future__ import annotations

import onnx
from onnx.defs import OpSchema

DOMAIN = "dspark"
DOMAIN_VERSION = 1
PLUGIN_NAMESPACE = "dspark"
PLUGIN_VERSION = "1"
FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
PLUGIN_ATTRIBUTES = {"plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION}


def register_schema(name: str, inputs, outputs, type_constraints, attributes, doc: str) -> None:
    """Register ``dspark::name`` with ``onnx.defs`` once per process (the exporter and the checker
    look schemas up there). ``inputs`` / ``outputs``: ``(name, type_str)`` pairs; ``attributes``:
    ``(name, OpSchema.AttrType)`` pairs, the plugin identity attributes added."""
    if onnx.defs.has(name, DOMAIN):
        return
    param = OpSchema.FormalParameter
    attrs = [OpSchema.Attribute(n, t, n) for n, t in attributes]
    attrs += [OpSchema.Attribute(n, OpSchema.AttrType.STRING, "TensorRT plugin identity")
              for n in PLUGIN_ATTRIBUTES]
    onnx.defs.register_schema(OpSchema(
        name, DOMAIN, DOMAIN_VERSION, doc=doc,
        inputs=[param(n, t) for n, t in inputs], outputs=[param(n, t) for n, t in outputs],
        type_constraints=type_constraints, attributes=attrs))
