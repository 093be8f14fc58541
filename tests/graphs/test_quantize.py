"""Weight-only int4 / int8 engines (``build --weights``): the graph form, what the build verifies
and records, a row's logits independent of how many rows share the call, and the greedy invariant
on quantized engines."""
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

import export.__main__ as cli
from common import manifest
from export import qdq, quantize
from export.build import build
from export.onnx_check import VerificationError
from plugins.cpu.build import library
from plugins.qmatmul import ort_lowering as qmatmul_lowering
from runtime.backends.ort import OrtBackend
from runtime.decoding.batch import generate

from conftest import LIMITS, PROMPTS
from oracles import OrtOracle

pytestmark = pytest.mark.slow   # the real-model tier: builds engines or runs servers

# int4 quantizes the draft too; int8 leaves it as it is (the default)
QUANTIZE_DRAFT = {"int4": True, "int8": False, "float": False}


@pytest.fixture(scope="module")
def engines(tiny, engine_dir, tmp_path_factory):
    """``engines(weights) -> (engine dir, folder of the graphs as traced before quantization,
    BuildResult)``, each built once; the float engine is ``engine_dir``'s (no traced graphs, no
    result)."""
    built = {}

    def make(weights):
        if weights == "float":
            return engine_dir(LIMITS), None, None
        if weights not in built:
            out, traced = tmp_path_factory.mktemp(weights), tmp_path_factory.mktemp("traced")
            rewrite = qdq.quantize_model

            def keeping_the_traced_graph(model, path, *args, **options):
                ir.save(model, traced / path.name, external_data=f"{path.name}.data")
                return rewrite(model, path, *args, **options)

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(qdq, "quantize_model", keeping_the_traced_graph)
                result = build(*map(str, tiny()), out, limits=LIMITS, weights=weights,
                               quantize_draft=QUANTIZE_DRAFT[weights], progress=False)
            built[weights] = out, traced, result
        return built[weights]

    return make


def _graphs(weights):
    return ("target", "draft") if QUANTIZE_DRAFT[weights] else ("target",)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_linear_layers_are_dequantize_linear_into_matmul(engines, weights):
    out, _, result = engines(weights)
    kind = {"int4": onnx.TensorProto.INT4, "int8": onnx.TensorProto.INT8}[weights]
    for name in _graphs(weights):
        graph = onnx.load(out / f"{name}.onnx", load_external_data=False).graph
        initializers = {t.name: t for t in graph.initializer}
        dequantize = {n.output[0]: n for n in graph.node if n.op_type == "DequantizeLinear"}
        assert result.quantized_layers[name] > 0
        for node in dequantize.values():
            q, scales = (initializers[i] for i in node.input)   # no zero point
            assert q.data_type == kind and scales.data_type == onnx.TensorProto.FLOAT
            assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} \
                == {"axis": 0, "block_size": 32}
            assert list(scales.dims) == [q.dims[0] // 32, q.dims[1]]
        matmuls = [n for n in graph.node if n.op_type in ("MatMul", "Gemm")]
        float_weights = [n.name for n in matmuls if n.input[1] in initializers
                         and len(initializers[n.input[1]].dims) == 2]
        assert float_weights == [] or name == "draft"   # the draft's Markov head stays float
        used = {i for n in graph.node for i in n.input}   # no float copy is left behind
        assert [t.name for t in graph.initializer if t.name not in used] == []
        quantized = [n for n in matmuls if n.input[1] in dequantize]
        # layers that read one input (q / k / v, gate / up) are one product, split after it
        split = {n.input[0]: len(n.output) for n in graph.node if n.op_type == "Split"}
        assert sum(split.get(n.output[0], 1) for n in quantized) == result.quantized_layers[name]
        assert len(quantized) < result.quantized_layers[name]
    assert ("Gemm" in {n.op_type for n in onnx.load(out / "target.onnx", load_external_data=False)
                       .graph.node}) is False   # lm_head too


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_dspark_nodes_and_functions_are_untouched_and_the_files_smaller(engines, weights):
    out, traced, _ = engines(weights)
    for name in _graphs(weights):
        before, after = (onnx.load(folder / f"{name}.onnx", load_external_data=False)
                         for folder in (traced, out))
        assert [n for n in after.graph.node if n.domain == "dspark"] \
            == [n for n in before.graph.node if n.domain == "dspark"] != []
        assert list(after.functions) == list(before.functions)
        smaller = (out / f"{name}.onnx.data").stat().st_size / (traced / f"{name}.onnx.data").stat().st_size
        assert smaller < {"int4": 0.3, "int8": 0.45}[weights]


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_the_token_embeddings_are_int8_rows_the_module_was_given(engines, weights):
    """A quantized graph gathers its token embeddings' int8 rows and scales (a quarter of the
    float32 table) rather than the float table; the module computed with the same values, which the
    build verified (it would have refused otherwise)."""
    out, traced, _ = engines(weights)
    for name in _graphs(weights):
        graph = onnx.load(out / f"{name}.onnx", load_external_data=False).graph
        stored = {t.name: t for t in graph.initializer}
        assert "embed_tokens.weight" not in stored
        rows = stored["embed_tokens.weight_rows_q"]
        assert rows.data_type == onnx.TensorProto.INT8
        before = onnx.load(traced / f"{name}.onnx").graph.initializer
        table = onnx.numpy_helper.to_array(next(t for t in before if t.name == "embed_tokens.weight"))
        assert list(rows.dims) == list(table.shape)
        blocks = quantize.rtn_blocks(8, 32)(np.ascontiguousarray(table.T))
        assert np.allclose(blocks.values().T, table, rtol=1e-6, atol=1e-6 * np.abs(table).max())


def test_the_rounding_is_onnx_runtimes():
    """``rtn`` gives the integers and scales of ONNX Runtime's own int4 quantizer."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )
    from onnxruntime.quantization.quant_utils import QuantFormat

    weight = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
    weight[3, 5], weight[40, 7], weight[41, 7] = 9.0, -9.0, 9.0   # ties of magnitude in a block
    h = onnx.helper
    graph = h.make_graph([h.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                         [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
                         [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 48])],
                         [onnx.numpy_helper.from_array(weight, "w")])
    config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, quant_format=QuantFormat.QDQ)
    tool = MatMulNBitsQuantizer(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)]),
                                algo_config=config)
    tool.process()
    initializers = {t.name: t for t in tool.model.model.graph.initializer}
    q, scales = quantize.rtn(weight, 4, 32)
    assert np.array_equal(ir.from_proto(initializers["w_DQ_Q4"]).numpy().astype(np.int8), q)
    assert np.array_equal(onnx.numpy_helper.to_array(initializers["w_DQ_scales"]), scales)
    # idempotent: the de-quantized values quantize to the same integers and scales
    again = quantize.rtn(quantize.Blocks(q, scales, 4).values(), 4, 32)
    assert np.array_equal(again[0], q) and np.array_equal(again[1], scales)


def test_a_weight_shared_through_a_transpose_is_quantized_once_and_not_kept(tmp_path):
    """The tracer passes a weight that several layers share (the draft's K/V projections, the
    unrolled Markov head) through one ``Transpose``: it is quantized once, each layer reads it
    through a ``DequantizeLinear`` of its own, so that ONNX Runtime fuses each into ``MatMulNBits``
    (a de-quantized copy that two layers read stays a float weight made at every step), and
    neither the float weight nor its ``Transpose`` is left behind."""
    h = onnx.helper
    weight = np.random.default_rng(0).standard_normal((48, 64)).astype(np.float32)   # [N, K]
    graph = h.make_graph(
        [h.make_node("Transpose", ["w"], ["w_t"], perm=[1, 0], name="share"),
         h.make_node("MatMul", ["x", "w_t"], ["y"], name="context"),
         h.make_node("MatMul", ["z", "w_t"], ["u"], name="block")], "g",
        [h.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [2, 64]) for name in ("x", "z")],
        [h.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [2, 48]) for name in ("y", "u")],
        [onnx.numpy_helper.from_array(weight, "w")])
    path = tmp_path / "shared.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)]), path)
    assert qdq.quantize_graph(path, quantize.rtn_blocks(4, 32)) == 2
    model = onnx.load(path)
    assert sorted(n.op_type for n in model.graph.node) == ["DequantizeLinear"] * 2 + ["MatMul"] * 2
    assert [t.name for t in model.graph.initializer if t.name == "w"] == []
    assert len(model.graph.initializer) == 4   # the int4 values and their scales, one copy per reader
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")   # float products
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    fused = [n.op_type for n in onnx.load(tmp_path / "optimized.onnx").graph.node]
    assert fused == ["MatMulNBits"] * 2
    x, z = np.random.default_rng(1).standard_normal((2, 2, 64)).astype(np.float32)
    y, u = session.run(None, {"x": x, "z": z})
    values = quantize.Blocks(*quantize.rtn(np.ascontiguousarray(weight.T), 4, 32), 4).values()
    assert np.allclose(y, x @ values, atol=1e-4) and np.allclose(u, z @ values, atol=1e-4)


def test_the_markov_head_stays_float_in_the_module_and_the_graph(tmp_path):
    """ONNX Runtime fuses the Markov head's product and the add of the base logits into a Gemm
    before it could fuse a DequantizeLinear, so a quantized Markov weight would be de-quantized at
    every step: the PyTorch reference and the graph both keep it float, and quantize the rest."""
    from modeling.draft import MarkovHead

    model = torch.nn.Module()
    model.head, model.proj = MarkovHead(100, 64, rank=32), torch.nn.Linear(32, 48, bias=False)
    markov, proj = model.head.markov_w2.weight.detach().clone(), model.proj.weight.detach().clone()
    assert quantize.float_weights(model) == {"head.markov_w2.weight"}
    assert quantize.quantize_linears(model, 4, 32) == 1
    assert torch.equal(model.head.markov_w2.weight, markov) and not torch.equal(model.proj.weight, proj)

    h = onnx.helper
    graph = h.make_graph(
        [h.make_node("MatMul", ["x", "proj.weight"], ["y"], name="proj"),
         h.make_node("MatMul", ["x", "head.markov_w2.weight"], ["z"], name="markov")], "g",
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 32])],
        [h.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in ("y", "z")],
        [onnx.numpy_helper.from_array(proj.numpy().T.copy(), "proj.weight"),
         onnx.numpy_helper.from_array(markov.numpy().T.copy(), "head.markov_w2.weight")])
    path = tmp_path / "markov.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)]), path)
    assert qdq.quantize_graph(path, quantize.rtn_blocks(4, 32), quantize.float_weights(model)) == 1
    nodes = {n.name: n for n in onnx.load(path).graph.node}
    assert nodes["markov"].input[1] == "head.markov_w2.weight"
    assert sorted(n.op_type for n in nodes.values()) == ["DequantizeLinear", "MatMul", "MatMul"]


def test_int8_scales_are_positive_for_tensorrt():
    """TensorRT's ONNX parser refuses a negative int8 scale: int8 maps a block's largest magnitude to
    +-127 with a positive scale, as idempotently as int4's rounding."""
    weight = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float16)
    weight[3, 5], weight[40, 7] = 9.0, -9.0
    q, scales = quantize.rtn(weight, 8, 32)
    assert (scales > 0).all() and q.min() >= -127 and q[3, 5] == 127 and q[40, 7] == -127
    again = quantize.rtn(quantize.Blocks(q, scales, 8).values(), 8, 32)
    assert np.array_equal(again[0], q) and np.array_equal(again[1], scales)


def test_the_manifest_records_the_weights_and_their_quality_cost(engines, capsys):
    out, _, result = engines("int4")
    weights = manifest.read(out)["weights"]
    assert {k: weights[k] for k in ("target", "draft", "block_size")} \
        == {"target": "int4", "draft": "int4", "block_size": 32}
    quality = weights["quality"]
    assert quality == result.quality and quality["tokens"] > 1000 and 0 < quality["top1_agreement"] <= 1
    assert manifest.read(engines("int8")[0])["weights"]["draft"] == "float"
    cli.main(["inspect", str(out)])
    assert "weights  target int4, draft int4 (symmetric RTN, blocks of 32); quantized target vs " \
           "unquantized on" in capsys.readouterr().out


def test_the_build_refuses_a_corrupted_quantized_weight(tiny, tmp_path, monkeypatch):
    """The graph is verified against a reference with the weights it should hold: one block of
    one layer with its scales' sign flipped fails the build (the draft's, the first graph built)."""
    rewrite = qdq.quantize_model

    def corrupted(model, path, blocks_of, *args, **options):
        def flipped(matrix):
            blocks = blocks_of(matrix)
            if blocks is not None:
                blocks.scales[0] = -blocks.scales[0]
            return blocks

        return rewrite(model, path, flipped, *args, **options)

    monkeypatch.setattr(qdq, "quantize_model", corrupted)
    with pytest.raises(VerificationError, match=r"draft.onnx: .* PyTorch reference"):
        build(*map(str, tiny()), tmp_path, limits=LIMITS, weights="int4", quantize_draft=True,
              progress=False)


def _logits(backend, prompt, tokens, split, neighbours=()):
    """The target's logits at the positions of ``tokens`` after ``prompt``, fed ``split`` rows
    per call, as sequence 0 of a batch whose other sequences are ``neighbours`` (prompts fed the
    same number of rows of their own)."""
    prompts = [prompt, *neighbours]
    backend.start(len(prompts))
    padded = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
    for b, ids in enumerate(prompts):
        padded[b, :len(ids)] = torch.tensor(ids)
    ends = torch.tensor([len(ids) for ids in prompts])
    backend.target_step(padded, torch.zeros(len(prompts), dtype=torch.long), (ends - 1)[:, None])
    position, rows = ends, []
    for count in split:
        chunk = torch.tensor(tokens[:count]).expand(len(prompts), count)
        tokens = tokens[count:]
        logits, _ = backend.target_step(chunk, position, torch.arange(count).expand(len(prompts), count))
        rows.append(logits[0].clone())
        position = position + count
    return torch.cat(rows)


@pytest.mark.parametrize("weights", ["int4", "int8", "float"])
def test_a_rows_logits_do_not_depend_on_its_call(engines, weights):
    """What the greedy invariant needs: a verify step's k + 1 rows give each row the logits that
    target-only decoding's one-row steps give it, and a sequence in a ragged batch the logits it
    has alone, bit for bit (on float weights too: ONNX Runtime's one-row MatMul is another kernel
    there as well, and its portable attention sums over the batch's longest sequence)."""
    backend = OrtBackend(engines(weights)[0])
    tokens = [20, 31, 42, 17, 60]
    alone = _logits(backend, PROMPTS[0], tokens, [5])
    for split in ([1] * 5, [2, 3], [4, 1]):
        assert torch.equal(_logits(backend, PROMPTS[0], tokens, split), alone), split
        for neighbours in (PROMPTS[1:], PROMPTS[2:], PROMPTS[:1]):   # longer, shorter, the same
            batched = _logits(backend, PROMPTS[0], tokens, split, neighbours)
            assert torch.equal(batched, alone), (split, neighbours)


@pytest.mark.parametrize("weights", ["int4", "int8", "float"])
def test_greedy_speculative_equals_target_only_at_every_batch_size(engines, weights):
    """On every weight format, at batch 1 .. max_batch with ragged prompts: speculative output
    (drafts accepted, so that verify steps carry several rows) equals target-only output, and a
    prompt's output in a batch equals its output alone."""
    out = engines(weights)[0]
    alone = [generate(OrtBackend(out), [p], max_new_tokens=40, speculative=False).token_ids[0]
             for p in PROMPTS]
    assert LIMITS.max_batch >= len(PROMPTS)
    for batch in range(1, len(PROMPTS) + 1):
        prompts = PROMPTS[-batch:]     # the longest prompt with the shorter ones
        expected = alone[-batch:]
        assert generate(OrtBackend(out), prompts, max_new_tokens=40, speculative=False).token_ids == expected
        result = generate(OrtOracle(out, prompts, expected), prompts, max_new_tokens=40)
        assert result.token_ids == expected, batch
        accepted = [r["accepted"] for r in result.trace if r["step"] > 0]
        assert max(accepted) == manifest.read(out)["draft"]["k"] and sum(accepted) > 10 * batch


@pytest.mark.parametrize("flags, words", [
    (["--weights", "int3"], ["--weights int3", "int4, int8, gguf"]),
    (["--weights", "int4", "--weights-block", "0"], ["--weights-block 0", "power of two"]),
    (["--weights", "int4", "--weights-block", "48"], ["--weights-block 48", "power of two"]),
    (["--quantize-draft"], ["--quantize-draft", "needs --weights int4, int8 or gguf"]),
    (["--weights", "float", "--quantize-draft"], ["--quantize-draft", "needs --weights int4, int8 or gguf"]),
    (["--weights", "gguf", "--weights-block", "64"], ["--weights-block 64", "blocks of 32"]),
    (["--weights", "gguf"], ["--weights gguf", "is not a .gguf file", "int4 or int8"]),
    (["--weights", "gguf", "--dtype", "fp16"], ["--weights gguf", "needs --dtype fp32, got fp16"]),
])
def test_bad_flags_are_refused_in_one_line(tiny, tmp_path, flags, words):
    target, draft = tiny()
    with pytest.raises(SystemExit) as refused:
        cli.main(["build", "--target", str(target), "--draft", str(draft), "--out", str(tmp_path / "e"),
                  "--max-seq-len", "64", "--quiet", *flags])
    message = str(refused.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    assert all(word in message for word in words), message
    assert not (tmp_path / "e").exists()


@pytest.mark.skipif(library() is None, reason="no compiler or no AVX2: the stock path runs")
@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_every_quantized_layer_runs_on_the_compiled_kernel(engines, weights):
    """The tests above run the engines as the backend loads them: each ``DequantizeLinear ->
    MatMul`` becomes the kernel's ``QMatMul`` (none is left to ONNX Runtime's ``MatMulNBits``),
    and the target runs a batch of sequences in one call (``plugins/cpu``), a float engine's too
    (its products on ``FMatMul``)."""

    out = engines(weights)[0]
    for graph in _graphs(weights):
        model = ir.load(out / f"{graph}.onnx")
        layers = sum(node.op_type == "DequantizeLinear" for node in model.graph)
        qmatmul_lowering.lower(model, f"{graph}.onnx")
        assert layers and sum(node.op_type == "QMatMul" for node in model.graph) == layers
        assert not any(node.op_type in ("DequantizeLinear", "MatMulNBits") for node in model.graph)
    assert OrtBackend(out).batched and OrtBackend(engines("float")[0]).batched


@pytest.mark.parametrize("fields", [{}, {"arch": "llama"}, {"draft_vocab": 40}, {"arch": "gemma4"}],
                         ids=["shared-untied", "shared-tied", "reduced-vocabulary", "gemma4"])
def test_a_rounded_drafts_weights_are_read_a_few_at_a_time(tiny, tmp_path, monkeypatch, fields):
    """A build of an int4 draft traces it on placeholders and reads each weight from the draft's
    files (or the target's, for shared embeddings) as the graph is written or as its layer runs,
    rounded as it is read (``quantize.rounded_as_read``): the weights and the reference are those
    of ``load_draft`` rounded by ``quantize_linears``, and no step holds more than a linear layer's
    weights beside the small ones (it held the draft in float32, rounded: 7 GB and more for a
    release's 8B draft)."""
    import weakref

    from export.onnx_export import BuildLimits, draft_spec, export_graph
    from export.verify_inputs import example_inputs, reference_outputs
    from modeling.draft import load_draft, load_draft_lazily
    from modeling.lazy_weights import resident

    target, draft = tiny(**fields)
    whole = load_draft(draft, target, markov_top_k=4)
    count = quantize.quantize_linears(whole, 4, 16, embeddings=True)
    module, weights = load_draft_lazily(draft, target, markov_top_k=4)
    assert quantize.rounded_as_read(module, weights, 4, 16, embeddings=True)[0] == count
    module, weights = load_draft_lazily(draft, target, markov_top_k=4)
    rounded, weights = quantize.rounded_as_read(module, weights, 4, 16, embeddings=True)
    assert all(p.stride() == (0,) * p.dim() for p in module.parameters())   # placeholders
    parameters = dict(module.named_parameters(remove_duplicate=False))
    assert parameters.keys() == dict(whole.named_parameters(remove_duplicate=False)).keys()
    for name, parameter in whole.named_parameters(remove_duplicate=False):
        assert torch.equal(weights.load(name), parameter), name
        assert parameters[name].dtype == parameter.dtype, name
    assert torch.equal(module.d2t, whole.d2t)

    read, held, alive = weights.load, [], []   # how many weights read are alive at each read

    def counted(name: str) -> torch.Tensor:
        values = read(name).numpy().copy()
        alive.append(weakref.ref(values))
        held.append(sum(ref() is not None for ref in alive))
        return torch.from_numpy(values)

    monkeypatch.setattr(weights, "load", counted)
    limits = BuildLimits(2, 64, 8)
    spec = draft_spec(module, limits)
    trace, verify = example_inputs(spec, limits, whole.target_vocab_size, whole.config.block_size,
                                   torch.Generator().manual_seed(0))
    export_graph(module, spec, trace, limits, tmp_path, 23, weights=weights)
    assert max(held) <= 2, held

    held.clear()
    with resident(module, weights):
        outputs = reference_outputs(module, verify)
    units = {id(p) for unit in module.weight_units() for p in unit.parameters()}
    rest = sum(id(p) not in units for p in module.parameters())
    assert max(held) <= rest + 1, (held, rest)
    assert all(p.stride() == (0,) * p.dim() for p in module.parameters())   # let go after
    for got, expected in zip(outputs, reference_outputs(whole, verify)):
        assert torch.equal(got, expected)


def test_a_graph_is_lowered_one_weight_at_a_time(engines, monkeypatch):
    """Lowering a quantized graph holds, as it packs each weight, the weights packed before it and
    that weight's values: none stays behind (``onnx_ir`` keeps the array it reads for as long as
    the tensor lives, the replaced nodes' too: at 8B the target's load peaked at 13.6 GB for
    4.5 GB packed)."""
    import tracemalloc

    from plugins.qmatmul import layout

    model = ir.load(engines("int4")[0] / "target.onnx")
    arrays = tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)
    seen, packed_bytes, pack = [], [0], layout.pack

    def packing(q, *args):
        alive = sum(t.size for t in tracemalloc.take_snapshot().filter_traces([arrays]).traces)
        packed = pack(q, *args)
        seen.append((alive - packed_bytes[0], q.size))
        packed_bytes[0] += sum(a.nbytes for a in (packed.q, packed.scales, packed.offsets, packed.sums,
                                                  packed.sub, packed.super))
        return packed

    monkeypatch.setattr(qmatmul_lowering, "pack", packing)
    tracemalloc.start()
    try:
        qmatmul_lowering.lower(model, "target.onnx")
    finally:
        tracemalloc.stop()
    largest, values = max(size for _, size in seen), sum(size for _, size in seen)
    assert len(seen) > 4 and values > 4 * largest
    assert max(extra for extra, _ in seen) < 2 * largest, seen
