"""TensorRT-RTX engines built on this CPU (ahead of time for a compute capability): our plugins
must be inside, for every dspark node of each graph. The only TensorRT evidence a machine without
a GPU can give, so it is strict."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("tensorrt_rtx")

from common import manifest as manifest_file  # noqa: E402
from export import qdq, quantize, trt_build  # noqa: E402
from export.build import add_engines  # noqa: E402
from export.trt_build import build_engines  # noqa: E402

from conftest import ENGINE_CASES, LIMITS  # noqa: E402

pytestmark = pytest.mark.slow   # builds engines: the real-model tier

ROOT = Path(__file__).resolve().parents[2]
RTX = dict(dtype="fp16", backend="trt-rtx", gpus=("sm89",))


@pytest.fixture(scope="module", params=ENGINE_CASES)
def engine(request, engine_dir, tmp_path_factory):
    """The case's fp16 engine (``engine_dir``'s, which other modules run on ONNX Runtime: a float
    graph is the same whatever the backend), copied, with the TensorRT-RTX engines that
    ``build --backend trt-rtx --gpu sm89`` adds."""
    out = tmp_path_factory.mktemp("rtx") / "engine"
    shutil.copytree(engine_dir(LIMITS, dtype="fp16", **ENGINE_CASES[request.param]), out)
    manifest = manifest_file.read(out)
    add_engines(out, manifest, RTX["backend"], RTX["gpus"])
    manifest_file.write(out, manifest)
    return out, manifest_file.read(out)


@pytest.fixture(scope="module")
def quantized(engine_dir):
    """The first engine case's pair with int4 weights, the draft's too, built for TensorRT-RTX
    (whose graphs keep the embedding float)."""
    out = engine_dir(LIMITS, weights="int4", quantize_draft=True, **RTX, **ENGINE_CASES["qwen3-native"])
    return out, json.loads((out / "manifest.json").read_text())


def _dspark_nodes(path):
    nodes = [n.op_type for n in onnx.load(path).graph.node if n.domain == "dspark"]
    return {op: nodes.count(op) for op in set(nodes)}


def test_engines_hold_our_plugins(engine):
    directory, manifest = engine
    assert manifest["backends"] == ["onnx", "trt-rtx"] and "trt-rtx" in manifest["tools"]
    entry = manifest["trt-rtx"]
    k = manifest["draft"]["k"]
    assert entry["plugin_layers"]["target"] == _dspark_nodes(directory / "target.onnx") == {
        "BlockAttention": manifest["target"]["decoder"]["num_layers"]}
    draft_layers = manifest["draft"]["decoder"]["num_layers"]
    assert entry["plugin_layers"]["draft"] == _dspark_nodes(directory / "draft.onnx") == {
        "BlockAttention": draft_layers, "CacheWrite": 2 * draft_layers, "D2TGather": k}
    for graph, file in entry["engines"]["sm89"].items():
        data = (directory / file).read_bytes()
        assert data[:4] == b"vtrt"                          # a TensorRT-RTX engine header
        assert b"dspark" in data and b"BlockAttention" in data
        assert (b"D2TGather" in data) == (b"CacheWrite" in data) == (graph == "draft")


def _parsed_layers(path):
    """The parsed network's dspark plugin layers and quantized weights, as ``_build`` checks them."""
    import tensorrt_rtx as trt

    from plugins.tensorrt_plugin import register_plugins

    creators = register_plugins(trt)  # noqa: F841  (the registry needs them alive while parsing)
    logger = trt_build._Logger(trt)
    network = trt.Builder(logger).create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    assert trt.OnnxParser(network, logger).parse_from_file(str(path))
    return trt_build._plugin_layers(trt, network), trt_build._quantized_weights(trt, network)


@pytest.mark.parametrize("engine", ["qwen3-native"], indirect=True)
def test_quantized_engines_hold_our_plugins_and_int4_weights(engine, quantized):
    """Built from the same quantized graphs as ONNX Runtime runs: every plugin layer is there, and
    every DequantizeLinear is a DEQUANTIZE layer of int4 weights. (The tiny pair's engines are
    mostly kernels, not weights: the next test shows the weights' share of an engine.)"""
    (fp16, fp16_manifest), (directory, manifest) = engine, quantized
    entry = manifest["trt-rtx"]
    assert manifest["weights"]["target"] == manifest["weights"]["draft"] == "int4"
    assert entry["plugin_layers"] == fp16_manifest["trt-rtx"]["plugin_layers"]
    for graph, file in entry["engines"]["sm89"].items():
        nodes = [n for n in onnx.load(directory / f"{graph}.onnx", load_external_data=False).graph.node
                 if n.op_type == "DequantizeLinear"]
        assert _parsed_layers(directory / f"{graph}.onnx") == (entry["plugin_layers"][graph],
                                                                {"int4": len(nodes)})
        assert nodes and _parsed_layers(fp16 / f"{graph}.onnx")[1] == {}
        assert b"BlockAttention" in (directory / file).read_bytes()


@pytest.mark.parametrize("weights, layers, share", [("int4", 1, 0.35), ("int8", 1, 0.65), ("int4", 3, 0.4)])
def test_quantized_matricesstay_quantized_in_the_engine(tmp_path, weights, layers, share):
    """1024 x 1024 linear layers of one input in the form ``build --weights`` writes (three: one
    product, split after it, as q / k / v are): TensorRT-RTX parses it (int8 scales must be
    positive) and its engine is about the int4 / int8 weights' size, not fp16's (three int4 layers
    measured 0.35 of fp16 fused, 0.28 each on its own)."""
    import tensorrt_rtx as trt
    from onnx import TensorProto, helper

    size = 1024
    rng = np.random.default_rng(0)
    nodes, matrices, outputs = [], [], []
    for index in range(layers):
        weight = rng.standard_normal((size, size)).astype(np.float16)
        weight[0, 0] = 9   # a block whose largest magnitude is positive
        nodes.append(helper.make_node("MatMul", ["x", f"w{index}"], [f"y{index}"], name=f"linear{index}"))
        matrices.append(onnx.numpy_helper.from_array(weight, f"w{index}"))
        outputs.append(helper.make_tensor_value_info(f"y{index}", TensorProto.FLOAT16, ["rows", size]))
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT16,
                                                                              ["rows", size])],
                              outputs, matrices)
    sizes = {}
    for name in ("fp16", weights):
        path = tmp_path / f"{name}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), path)
        if name == weights:
            assert qdq.quantize_graph(path, quantize.rtn_blocks(quantize.BITS[weights], 32)) == layers
        profiles = {"decode": {"x": ((1, size), (4, size), (16, size))}}
        assert _parsed_layers(path) == ({}, {} if name == "fp16" else {weights: 1})
        engine = tmp_path / f"{name}.engine"
        trt_build._build(trt, trt_build._Logger(trt), path, profiles, "sm89", None, engine)
        sizes[name] = engine.stat().st_size
    assert sizes[weights] < share * sizes["fp16"], sizes


def test_cache_outputs_alias_their_inputs():
    """The plugins as TensorRT-RTX sees them: the BUILD capability is the V2 interface, whose
    ``get_aliased_input`` makes each cache output share its input's buffer (written in place)."""
    import numpy as np
    import tensorrt_rtx as trt

    from plugins.tensorrt_plugin import register_plugins, specs

    assert {spec.name: spec.aliases for spec in specs()} == {
        "BlockAttention": {1: 3, 2: 4}, "CacheWrite": {0: 0}, "D2TGather": {}, "GatedDeltaRule": {1: 5},
        "MoeExperts": {}, "MoeExpertsInt8": {}, "MoeExpertsInt4": {}}
    attributes = trt.PluginFieldCollection([
        trt.PluginField("causal", np.array([0], np.int32), trt.PluginFieldType.INT32),
        trt.PluginField("scale", np.array([0.25], np.float32), trt.PluginFieldType.FLOAT32),
        trt.PluginField("window", np.array([0], np.int32), trt.PluginFieldType.INT32),
        trt.PluginField("activation", np.array([0], np.int32), trt.PluginFieldType.INT32)])
    expected = {"BlockAttention": [-1, 3, 4], "CacheWrite": [0], "D2TGather": [-1, -1],
                "GatedDeltaRule": [-1, 5], "MoeExperts": [-1], "MoeExpertsInt8": [-1], "MoeExpertsInt4": [-1]}
    for creator in register_plugins(trt):
        plugin = creator.create_plugin(creator.name, attributes, trt.TensorRTPhase.BUILD)
        build = plugin.get_capability_interface(trt.PluginCapabilityType.BUILD)
        assert isinstance(build, trt.IPluginV3OneBuildV2)
        assert [build.get_aliased_input(i) for i in range(plugin.num_outputs)] == expected[creator.name]


def test_plugins_reserve_the_workspace_their_kernels_need():
    """TensorRT hands ``enqueue`` the scratch memory ``get_workspace_size`` asked for at the
    profile's largest shapes: the split attention keeps its partial results there, the experts
    their pair lists and rows (allocating during a captured launch is not allowed)."""
    from types import SimpleNamespace

    import numpy as np
    import tensorrt_rtx as trt

    from plugins.block_attention.triton_kernel import workspace_bound
    from plugins.moe.triton_kernel import workspace_bytes
    from plugins.tensorrt_plugin import register_plugins

    attributes = trt.PluginFieldCollection([
        trt.PluginField("causal", np.array([1], np.int32), trt.PluginFieldType.INT32),
        trt.PluginField("scale", np.array([0.25], np.float32), trt.PluginFieldType.FLOAT32),
        trt.PluginField("window", np.array([0], np.int32), trt.PluginFieldType.INT32),
        trt.PluginField("activation", np.array([0], np.int32), trt.PluginFieldType.INT32)])
    shapes = [(4, 32, 2048, 128)]                                  # BlockAttention's q; others ignore it
    routing = [(72, 2048), (72, 8), (72, 8)]                       # 72 tokens of hidden 2048, top 8
    inputs = {"MoeExperts": routing + [(128, 1536, 2048), (128, 2048, 768)],
              # 128 experts of 768, blocks of 32: integers and scales, block-major
              "MoeExpertsInt8": routing + [(128, 64, 32, 1536), (128, 64, 1536), (128, 24, 32, 2048),
                                           (128, 24, 2048)],
              "MoeExpertsInt4": routing + [(128, 64, 16, 1536), (128, 64, 1536), (128, 24, 16, 2048),
                                           (128, 24, 2048)]}
    sizes = {creator.name: creator.create_plugin(creator.name, attributes, trt.TensorRTPhase.BUILD)
             .get_workspace_size([SimpleNamespace(max=m) for m in inputs.get(creator.name, shapes)], [])
             for creator in register_plugins(trt)}
    experts = workspace_bytes(72, 8, 128, 2048, 768)
    assert sizes == {"BlockAttention": workspace_bound(128), "CacheWrite": 0, "D2TGather": 0,
                     "GatedDeltaRule": 0, "MoeExperts": experts, "MoeExpertsInt8": experts,
                     "MoeExpertsInt4": experts}
    assert workspace_bound(128) > 0 and experts > 0


def test_profiles_follow_the_limits(engine):
    _, manifest = engine
    k = manifest["draft"]["k"]
    profiles = manifest["trt-rtx"]["profiles"]
    batch, chunk = LIMITS.max_batch, LIMITS.max_prompt_chunk
    assert chunk != k + 1
    assert profiles["target"]["prefill"]["input_ids"] == [[1, 1], [batch, chunk], [batch, chunk]]
    assert profiles["target"]["decode"]["input_ids"] == [[1, 1], [batch, k + 1], [batch, k + 1]]
    # logits for one row per prompt in prefill, k + 1 rows when verifying
    assert profiles["target"]["prefill"]["logit_rows"] == [[1, 1], [batch, 1], [batch, k + 1]]
    assert profiles["target"]["decode"]["logit_rows"] == [[1, 1], [batch, k + 1], [batch, k + 1]]
    assert profiles["draft"]["decode"]["ctx_aux"][2][1] == k + 1
    assert profiles["draft"]["prefill"]["k_cache_0"][2][0] == batch


def test_a_namespace_mismatch_is_caught_not_inlined(engine, tmp_path):
    """With creators under another namespace the parser silently inlines the function bodies;
    the build must refuse. Its own process: the plugin registry is process-global."""
    directory, _ = engine
    script = f"""
import json, sys
from pathlib import Path
import plugins.tensorrt_plugin as p
p.PLUGIN_NAMESPACE = "elsewhere"
from export.trt_build import build_engines, EngineBuildError

manifest = json.loads(Path({str(directory)!r}, "manifest.json").read_text())
try:
    build_engines(Path({str(directory)!r}), manifest, "trt-rtx", ["sm89"])
except EngineBuildError as err:
    print("REFUSED", err)
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert "REFUSED" in result.stdout and "inlined the function body" in result.stdout, result.stderr[-2000:]


def test_bad_gpu_and_backend_flags(engine):
    directory, manifest = engine
    with pytest.raises(ValueError, match="--gpu sm90"):
        build_engines(directory, manifest, "trt-rtx", ["sm90"])
    with pytest.raises(ValueError, match="--backend tensorrt"):
        build_engines(directory, manifest, "tensorrt", [])


def test_trt_backend_refuses_clearly_without_a_gpu(engine, tmp_path):
    import torch

    import runtime.generate as cli

    directory, _ = engine
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="--backend trt-rtx needs a CUDA GPU; use --backend ort"):
        cli.main(["--engine", str(directory), "--prompt", "hi", "--backend", "trt-rtx"])
    with pytest.raises(SystemExit, match="no trt engines .* --backend trt"):
        cli.main(["--engine", str(directory), "--prompt", "hi", "--backend", "trt"])
