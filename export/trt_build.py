"""TensorRT and TensorRT-RTX engines from an engine directory's ONNX graphs, with our plugins.

The network is strongly typed (precision comes from the graph: build it with ``--dtype fp16`` or
``bf16``), weight-only int4 / int8 included: TensorRT-RTX has no INT4 / INT8 builder flags, and a
graph's blocked ``DequantizeLinear`` -> ``MatMul`` (``build --weights``) becomes a DEQUANTIZE layer
of int4 / int8 weights, which the engine keeps at that size. Each graph gets two optimization
profiles from the manifest limits: ``prefill`` (rows up to the prompt chunk) and ``decode`` (rows up
to ``k + 1``). TensorRT-RTX builds ahead of time for named compute capabilities and needs no GPU;
full TensorRT builds for the GPU it runs on and keeps a timing cache.
"""
from __future__ import annotations

from pathlib import Path

import onnx

from common.errors import EngineBuildError
from export.build_checks import check_gpus
from plugins.onnx_domain import DOMAIN
from plugins.tensorrt_module import import_tensorrt
from plugins.tensorrt_plugin import register_plugins

PROFILES = ("prefill", "decode")


def build_engines(directory: Path, manifest: dict, backend: str, gpus: list[str]) -> dict:
    """Build ``GRAPH.GPU.engine`` for each graph and GPU into ``directory``. Returns the manifest
    entry: engine files per GPU, profiles, plugin layers found, tool version."""
    targets = check_gpus(backend, gpus)
    trt = import_tensorrt(backend)
    creators = register_plugins(trt)  # noqa: F841  (the registry needs them alive while building)
    logger = _Logger(trt)
    entry = {"engines": {}, "profiles": {}, "plugin_layers": {}, "version": trt.__version__}
    # a timing cache speeds up rebuilds with TensorRT; in TensorRT-RTX it is a deprecated no-op
    cache_path = directory / "timing.trt.cache" if backend == "trt" else None
    for gpu in targets or ["local"]:
        entry["engines"][gpu] = {}
        for graph, spec in manifest["graphs"].items():
            profiles = _profiles(spec, manifest)
            name = f"{graph}.{gpu}.engine"
            plugins = _build(trt, logger, directory / spec["file"], profiles, gpu, cache_path,
                             directory / name)
            entry["engines"][gpu][graph] = name
            entry["profiles"][graph] = {profile: {n: list(s) for n, s in shapes.items()}
                                        for profile, shapes in profiles.items()}
            entry["plugin_layers"][graph] = plugins
    return entry


def _profiles(spec: dict, manifest: dict) -> dict[str, dict[str, tuple]]:
    """Per profile, each dynamic input's (min, opt, max) shapes from the build limits. The target
    returns logits for 1 row per prompt in prefill and ``k + 1`` when verifying: up to ``k + 1``
    logit rows (and a hybrid's kept states) in either profile."""
    limits, k = manifest["limits"], manifest["draft"]["k"]
    batch = (1, limits["max_batch"], limits["max_batch"])
    rows = {"prefill": (1, limits["max_prompt_chunk"], max(limits["max_prompt_chunk"], k + 1)),
            "decode": (1, k + 1, k + 1)}
    logit_rows = {"prefill": (1, 1, k + 1), "decode": (1, k + 1, k + 1)}
    profiles = {}
    for name in PROFILES:
        # a hybrid target keeps as many states as it returns logit rows: 1 in prefill, k + 1 to verify
        axes = {"batch": batch, "rows": rows[name], "ctx_rows": rows[name], "logit_rows": logit_rows[name],
                "state_rows": logit_rows[name]}
        profiles[name] = {
            t["name"]: tuple(tuple(axes[d][i] if isinstance(d, str) else d for d in t["shape"])
                             for i in range(3))
            for t in spec["inputs"] if any(isinstance(d, str) for d in t["shape"])}
    return profiles


def _build(trt, logger, onnx_path: Path, profiles: dict, gpu: str, cache_path: Path | None,
           engine_path: Path) -> dict[str, int]:
    """Build one engine into ``engine_path``; returns the plugin layers found. Every dspark node
    must be a plugin layer, and every ``DequantizeLinear`` a DEQUANTIZE layer of its int4 / int8
    weights (not weights the parser turned into floats)."""
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(parser.get_error(i).desc() for i in range(parser.num_errors))
        raise EngineBuildError(f"{onnx_path.name}: the ONNX parser failed: {errors}")
    plugins, quantized = _plugin_layers(trt, network), _quantized_weights(trt, network)
    expected, expected_quantized = _onnx_nodes(onnx_path)
    if plugins != expected:
        raise EngineBuildError(
            f"{onnx_path.name}: expected dspark plugin layers {expected}, the parsed network has "
            f"{plugins}; a creator did not match and the parser inlined the function body")
    if quantized != expected_quantized:
        raise EngineBuildError(
            f"{onnx_path.name}: expected DequantizeLinear of {expected_quantized} weights, the parsed "
            f"network dequantizes {quantized}; a quantized weight would be built as floats")
    config = _config(trt, builder, profiles, gpu, cache_path)
    with engine_path.open("wb") as file:
        # streamed to the file as it is serialized: the engine is never held whole in memory
        # beside the builder's own copy of the weights
        writer = _FileWriter(trt, file)
        built = builder.build_serialized_network_to_stream(network, config, writer)
    if writer.error is not None:   # TensorRT logs a writer's exception and carries on
        engine_path.unlink()
        raise OSError(writer.error.errno, writer.error.strerror, str(engine_path))
    if not built:
        engine_path.unlink()
        raise EngineBuildError(f"{onnx_path.name}: the engine build for {gpu} failed: "
                               f"{logger.last_error or 'see the TensorRT log'}")
    if cache_path is not None:
        cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
    return plugins


def _config(trt, builder, profiles: dict, gpu: str, cache_path: Path | None):
    """The builder config: ``profiles``, the target GPU or the timing cache, aliased plugin I/O (the
    plugins' cache outputs share their inputs' buffers; TensorRT refuses them without it), and for
    TensorRT-RTX the user allocation that stream capture needs (its engines may otherwise allocate
    at run time, which a captured CUDA graph cannot)."""
    config = builder.create_builder_config()
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    for shapes in profiles.values():
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in shapes.items():
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
    if hasattr(trt.BuilderFlag, "REQUIRE_USER_ALLOCATION"):   # TensorRT-RTX only
        config.set_flag(trt.BuilderFlag.REQUIRE_USER_ALLOCATION)
    if cache_path is not None:
        cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.exists() else b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
    if gpu != "local":
        config.num_compute_capabilities = 1
        config.set_compute_capability(getattr(trt.ComputeCapability, gpu.upper()), 0)
    return config


def _plugin_layers(trt, network) -> dict[str, int]:
    """How many plugin layers of each ``dspark`` op the parsed network holds."""
    counts: dict[str, int] = {}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.PLUGIN_V3:
            layer.__class__ = trt.IPluginV3Layer  # the bindings return the base class
            core = layer.plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
            if core.plugin_namespace == DOMAIN:
                counts[core.plugin_name] = counts.get(core.plugin_name, 0) + 1
    return counts


def _quantized_weights(trt, network) -> dict[str, int]:
    """How many DEQUANTIZE layers of the parsed network read weights of each quantized type."""
    counts: dict[str, int] = {}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.DEQUANTIZE:
            kind = layer.get_input(0).dtype.name.lower()
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def _onnx_nodes(onnx_path: Path) -> tuple[dict[str, int], dict[str, int]]:
    """The main graph's ``dspark`` nodes per op, and its ``DequantizeLinear`` nodes per weight
    type: what ``_plugin_layers`` and ``_quantized_weights`` must find after parsing."""
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    types = {t.name: onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name for t in graph.initializer}
    custom: dict[str, int] = {}
    quantized: dict[str, int] = {}
    for node in graph.node:
        if node.domain == DOMAIN:
            custom[node.op_type] = custom.get(node.op_type, 0) + 1
        elif node.op_type == "DequantizeLinear":
            kind = types.get(node.input[0], "computed")
            quantized[kind] = quantized.get(kind, 0) + 1
    return custom, quantized


def _FileWriter(trt, file):
    class FileWriter(trt.IStreamWriter):
        """Writes each piece of the serialized engine to ``file`` as the builder hands it over."""

        def __init__(self):
            trt.IStreamWriter.__init__(self)
            self.error: OSError | None = None

        def write(self, data) -> int:
            """The bytes written; 0 tells TensorRT the write failed (the error is kept for
            ``_build``: an exception raised here would only be logged)."""
            if self.error is not None:
                return 0
            try:
                return file.write(data)
            except OSError as err:
                self.error = err
                return 0

    return FileWriter()


def _Logger(trt):
    class Logger(trt.ILogger):
        """Keeps errors for the build's message; prints nothing unless asked."""

        def __init__(self):
            trt.ILogger.__init__(self)
            self.last_error = ""

        def log(self, severity, message):
            if severity <= trt.ILogger.Severity.ERROR:
                self.last_error = message

    return Logger()
