"""The fp32 island at the draft's context input (issue 13, item 3): in an fp16 draft ``fc`` and
``hidden_norm`` compute in fp32, so target taps as large as Qwen3's (~2e4) cannot overflow.
Checked in PyTorch, in the exported graph and in TensorRT's strongly typed network; in PyTorch and
in the graph also against the same computation without the island, which overflows."""
import copy
import json
from collections import defaultdict

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx.reference import ReferenceEvaluator

from export.onnx_export import draft_spec
from modeling.pair import load_pair

from conftest import ENGINE_CASES, LIMITS

pytestmark = pytest.mark.slow   # the real-model tier: builds engines or runs servers

CASE = ENGINE_CASES["qwen3-native"]
BATCH, ROWS = 3, 6
FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16


@pytest.fixture(scope="module")
def drafts(tiny):
    return {dtype: load_pair(*tiny(**CASE), dtype=dtype)[1] for dtype in (torch.float32, torch.float16)}


@pytest.fixture(scope="module")
def fp16_engine(engine_dir):
    return engine_dir(LIMITS, dtype="fp16", **CASE)


def _inputs(draft) -> dict[str, torch.Tensor]:
    """Greedy inputs whose context rows are taps of magnitude 3e4 with random signs: a row of them
    times ``fc`` exceeds fp16's 65504 in a few percent of the outputs."""
    generator = torch.Generator().manual_seed(0)
    taps = 3e4 * torch.randn(BATCH, ROWS, draft.fc.in_features, generator=generator).sign()
    names = [t.name for t in draft_spec(draft, LIMITS).inputs]
    return dict(zip(names, [
        taps.to(draft.lm_head.weight.dtype), torch.zeros(BATCH, dtype=torch.long),
        torch.full((BATCH,), ROWS), torch.tensor([5, 6, 7]), torch.ones(BATCH),
        torch.zeros(BATCH, draft.k, draft.config.draft_vocab_size),
        *draft.empty_cache(BATCH, LIMITS.max_seq_len)]))


def _module_tokens(draft) -> torch.Tensor:
    return draft(*_inputs(draft).values())[0]


def test_module_fp16_drafts_equal_fp32_drafts_on_large_taps(drafts):
    fp32, fp16 = drafts[torch.float32], drafts[torch.float16]
    expected = _module_tokens(fp32)
    assert torch.equal(_module_tokens(fp16), expected)
    assert fp16.precision() == {"fc": torch.float32, "hidden_norm": torch.float32, "rest": torch.float16}
    # the same draft with fc and hidden_norm in fp16, as it was before the island: overflow, wrong drafts
    without = copy.deepcopy(fp16)
    without.fc.half()
    without.hidden_norm.half()
    assert without.fc(_inputs(without)["ctx_aux"]).isinf().any()
    assert not torch.equal(_module_tokens(without), expected)


def _island(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, int]]:
    """The nodes that compute on ``ctx_aux`` (shapes aside) up to each Cast to float16, with the
    element type each produces; any other node that produces float16 there fails."""
    inferred = onnx.shape_inference.infer_shapes(model).graph.value_info
    types = {v.name: v.type.tensor_type.elem_type for v in inferred}
    consumers = defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            consumers[name].append(node)
    island, seen, frontier = [], set(), ["ctx_aux"]
    while frontier:
        for node in consumers[frontier.pop()]:
            produced = types[node.output[0]]
            if produced == onnx.TensorProto.INT64 or node.name in seen:
                continue
            seen.add(node.name)
            island.append((node, produced))
            if produced == FLOAT:
                frontier.extend(node.output)
            else:
                assert node.op_type == "Cast", f"{node.name} computes in float16 inside the island"
    return island


def test_exported_graph_has_the_island_and_manifest_says_so(fp16_engine):
    model = onnx.load(fp16_engine / "draft.onnx", load_external_data=False)
    kinds = [(node.op_type, produced) for node, produced in _island(model)]
    assert kinds[0] == ("Cast", FLOAT) and ("MatMul", FLOAT) in kinds and ("Cast", FLOAT16) in kinds, kinds
    assert json.loads((fp16_engine / "manifest.json").read_text())["draft"]["precision"] == {
        "fc": "float32", "hidden_norm": "float32", "rest": "float16"}


def _without_island(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph with the island computed in float16, as a build without it would: ctx_aux
    cast to float16 instead of float32, and the island's weights float16."""
    island = [node for node, _ in _island(model)]
    next(a for a in island[0].attribute if a.name == "to").i = FLOAT16
    used = {name for node in island for name in node.input}
    for weight in model.graph.initializer:
        if weight.name in used and weight.data_type == FLOAT:
            array = onnx.numpy_helper.to_array(weight).astype(np.float16)
            weight.CopyFrom(onnx.numpy_helper.from_array(array, weight.name))
    del model.graph.value_info[:]
    return model


def test_fp16_graph_drafts_equal_fp32_graph_drafts_on_large_taps(fp16_engine, engine_dir, drafts):
    """In ONNX Runtime, the runtime's CPU backend, and in ONNX's reference evaluator, which rounds
    every op's output to its graph dtype as TensorRT and GPU kernels do. ONNX Runtime's CPU
    provider cannot show the overflow: it has no fp16 MatMul, runs it in fp32 between Casts it
    inserts, and keeps the chain into hidden_norm in fp32."""
    def ort_tokens(path, inputs):
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        return session.run(["tokens"], {name: t.numpy() for name, t in inputs.items()})[0]

    def reference_tokens(model, inputs):
        with np.errstate(over="ignore", invalid="ignore"):  # the overflow is the point
            return ReferenceEvaluator(model).run(["tokens"], {n: t.numpy() for n, t in inputs.items()})[0]

    expected = ort_tokens(str(engine_dir(LIMITS, **CASE) / "draft.onnx"), _inputs(drafts[torch.float32]))
    assert np.array_equal(expected, _module_tokens(drafts[torch.float32]).numpy())
    inputs, path = _inputs(drafts[torch.float16]), fp16_engine / "draft.onnx"
    assert np.array_equal(ort_tokens(str(path), inputs), expected)
    assert np.array_equal(reference_tokens(onnx.load(path), inputs), expected)
    assert not np.array_equal(reference_tokens(_without_island(onnx.load(path)), inputs), expected)


def test_tensorrt_strongly_typed_network_keeps_the_island(fp16_engine):
    """TensorRT takes each layer's precision from the graph: fc's matrix multiply and the norm
    stay float32 until the Cast to float16."""
    pytest.importorskip("tensorrt_rtx")
    from plugins.tensorrt_module import import_tensorrt
    from plugins.tensorrt_plugin import register_plugins

    trt = import_tensorrt("trt-rtx")
    creators = register_plugins(trt)  # noqa: F841  (kept alive while parsing)
    logger = trt.Logger(trt.Logger.ERROR)
    network = trt.Builder(logger).create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    assert trt.OnnxParser(network, logger).parse_from_file(str(fp16_engine / "draft.onnx"))
    consumers = defaultdict(list)
    for layer in map(network.get_layer, range(network.num_layers)):
        for i in range(layer.num_inputs):
            if layer.get_input(i) is not None:
                consumers[layer.get_input(i).name].append(layer)
    island, frontier = {}, ["ctx_aux"]
    while frontier:
        for layer in consumers[frontier.pop()]:
            out = layer.get_output(0)
            if out.dtype in (trt.int64, trt.int32) or layer.name in island:
                continue
            island[layer.name] = (layer.type, out.dtype)
            if out.dtype == trt.float32:
                frontier.append(out.name)
            else:
                assert (layer.type, out.dtype) == (trt.LayerType.CAST, trt.float16), layer.name
    kinds = list(island.values())
    assert kinds[0] == (trt.LayerType.CAST, trt.float32), kinds
    assert (trt.LayerType.MATRIX_MULTIPLY, trt.float32) in kinds, kinds
    assert (trt.LayerType.CAST, trt.float16) in kinds, kinds
