"""The ``dspark`` operators as TensorRT plugins (``IPluginV3`` with an ``IPluginCreatorV3One``
creator), written once for both ``tensorrt`` and ``tensorrt_rtx``: the module is passed in, since
the plugin base classes come from it.

Each operator describes itself with a ``PluginSpec`` (``trt_plugin_spec.py``) in its own folder
(``trt_plugin.py``): its
attributes, output types and shapes, accepted formats, and ``enqueue``, which launches the Triton
kernel on the stream TensorRT gives. Creators must match the ONNX node exactly (op type,
``plugin_version``, ``plugin_namespace``), or the parser silently inlines the function body
instead; the engine builder checks that plugin layers are present.

A cache output is declared an alias of its cache input (``IPluginV3OneBuildV2.get_aliased_input``,
TensorRT >= 10.3 and TensorRT-RTX): TensorRT then gives both one buffer, and the plugin updates
the cache in place instead of copying it whole on every call. The builder refuses such a plugin
unless ``PreviewFeature.ALIASED_PLUGIN_IO_10_03`` is enabled.
"""
from __future__ import annotations

import numpy as np

from .onnx_domain import PLUGIN_NAMESPACE, PLUGIN_VERSION
from .trt_plugin_spec import PluginSpec


def specs() -> list[PluginSpec]:
    from .block_attention.trt_plugin import SPEC as block_attention
    from .cache_write.trt_plugin import SPEC as cache_write
    from .d2t_gather.trt_plugin import SPEC as d2t_gather
    from .gated_delta.trt_plugin import SPEC as gated_delta
    from .moe.trt_plugin import INT4_SPEC, INT8_SPEC
    from .moe.trt_plugin import SPEC as moe

    return [block_attention, cache_write, d2t_gather, gated_delta, moe, INT8_SPEC, INT4_SPEC]


def register_plugins(trt) -> list:
    """Register every ``dspark`` creator with ``trt``'s plugin registry. Keep the returned
    creators alive as long as the registry may use them."""
    registry = trt.get_plugin_registry()
    creators = [_creator_class(trt)(spec) for spec in specs()]
    for creator in creators:
        if registry.get_creator(creator.name, PLUGIN_VERSION, PLUGIN_NAMESPACE) is None:
            registry.register_creator(creator, PLUGIN_NAMESPACE)
    return creators


_FIELD_TYPES = {"int": ("INT32", np.int32), "float": ("FLOAT32", np.float32)}


def _creator_class(trt):
    plugin_class = _plugin_class(trt)

    class Creator(trt.IPluginCreatorV3One):
        def __init__(self, spec: PluginSpec):
            trt.IPluginCreatorV3One.__init__(self)
            self.spec = spec
            self.name = spec.name
            self.plugin_namespace, self.plugin_version = PLUGIN_NAMESPACE, PLUGIN_VERSION
            self.field_names = trt.PluginFieldCollection([
                trt.PluginField(n, np.array([]), getattr(trt.PluginFieldType, _FIELD_TYPES[t][0]))
                for n, t in spec.fields.items()])

        def create_plugin(self, name, fields, phase):
            attrs = {}
            for given in fields:
                if given.name in self.spec.fields:
                    kind = self.spec.fields[given.name]
                    value = np.asarray(given.data).ravel()[0]
                    attrs[given.name] = int(value) if kind == "int" else float(value)
            missing = set(self.spec.fields) - set(attrs)
            if missing:
                raise ValueError(f"dspark::{self.spec.name}: missing attribute(s) {sorted(missing)}")
            return plugin_class(self.spec, attrs)

    return Creator


def _plugin_class(trt):
    class Plugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuildV2, trt.IPluginV3OneRuntime):
        def __init__(self, spec: PluginSpec, attrs: dict):
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuildV2.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.spec, self.attrs = spec, attrs
            self.num_outputs = spec.num_outputs
            self.plugin_name = spec.name
            self.plugin_namespace, self.plugin_version = PLUGIN_NAMESPACE, PLUGIN_VERSION

        def get_capability_interface(self, kind):
            return self     # the BUILD capability is the V2 interface, which declares the aliases

        def clone(self):
            return Plugin(self.spec, dict(self.attrs))

        def get_output_data_types(self, input_types):
            return self.spec.output_types(trt, input_types)

        def get_output_shapes(self, inputs, shape_inputs, builder):
            return self.spec.output_shapes(trt, inputs, builder)

        def supports_format_combination(self, pos, in_out, num_inputs):
            return (in_out[pos].desc.format == trt.TensorFormat.LINEAR
                    and self.spec.supports(trt, pos, in_out, num_inputs))

        def get_aliased_input(self, output_index):
            return self.spec.aliases.get(output_index, -1)

        def configure_plugin(self, inputs, outputs):
            pass

        def on_shape_change(self, inputs, outputs):
            pass

        def get_workspace_size(self, inputs, outputs):
            return self.spec.workspace(inputs) if self.spec.workspace else 0

        def get_valid_tactics(self):
            return []

        def set_tactic(self, tactic):
            pass

        def attach_to_context(self, context):
            return self.clone()

        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            self.spec.enqueue(trt, self.attrs, input_desc, output_desc, inputs, outputs, workspace, stream)

        def get_fields_to_serialize(self):
            return trt.PluginFieldCollection([
                trt.PluginField(n, np.array([self.attrs[n]], dtype=_FIELD_TYPES[t][1]),
                                getattr(trt.PluginFieldType, _FIELD_TYPES[t][0]))
                for n, t in self.spec.fields.items()])

    return Plugin
