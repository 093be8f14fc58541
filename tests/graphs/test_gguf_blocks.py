"""``build --weights gguf``: a GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks, found by a weight's values
and written as ``DequantizeLinear -> MatMul`` (plus Q4_1's per-block offsets), which ONNX Runtime
runs as ``MatMulNBits`` computing with exactly the file's weights; a row's result does not depend on
how many rows share the call. The demo build with these weights: ``tests/graphs/test_gguf.py``."""
import importlib.util

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from export import qdq

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf extra")
K, N = 128, 48
TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A GGUF file with one ``[N, K]`` weight per type (rows out, as llama.cpp stores them), and
    each weight's de-quantized values ``[K, N]``, as ``transformers`` gives them to the build."""
    import gguf
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    weights = {}
    for kind in TYPES:
        qtype = gguf.GGMLQuantizationType[kind]
        # an offset per row, so that Q4_1's minimum is not Q4_0's -8 d
        raw = gguf_quantize((rng.standard_normal((N, K)) + rng.standard_normal((N, 1))).astype(np.float32),
                            qtype)
        writer.add_tensor(kind, raw, raw_dtype=qtype)
        weights[kind] = np.ascontiguousarray(dequantize(raw, qtype).T)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, weights


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_weight_is_found_by_its_values_in_any_row_order(gguf_file, kind):
    from export.gguf_blocks import GgufBlocks

    path, weights = gguf_file
    blocks = GgufBlocks(path)
    order = np.random.default_rng(1).permutation(N)   # transformers permutes q / k projections' rows
    for matrix in (weights[kind], np.ascontiguousarray(weights[kind][:, order])):
        found = blocks.lookup(matrix)
        assert found.bits == (8 if kind == "Q8_0" else 4) and found.block == 32
        assert (found.offsets is not None) == (kind == "Q4_1")
        assert -2 ** (found.bits - 1) <= found.q.min() and found.q.max() < 2 ** (found.bits - 1)
        assert np.array_equal(found.values(), matrix)


def test_a_weight_not_in_the_file_as_a_supported_type_is_not_found(gguf_file):
    from export.gguf_blocks import GgufBlocks

    path, weights = gguf_file
    blocks = GgufBlocks(path)
    assert blocks.lookup(weights["F16"]) is None                 # an F16 tensor: no blocks to keep
    changed = weights["Q4_1"].copy()
    changed[5, 7] += 1e-3                                        # one value not the file's
    assert blocks.lookup(changed) is None
    assert blocks.types == sorted(TYPES)


def test_q4_1_runs_as_matmulnbits_with_the_files_weights(gguf_file, tmp_path):
    """The graph ONNX Runtime runs computes with the file's weights: at accuracy level 0 (float
    activations) as closely as a float MatMul does, at level 4 (int8 activations, the engines'
    setting) within its rounding; and a row's result is the same in every call of 2 or more rows."""
    from export.gguf_blocks import GgufBlocks

    path, weights = gguf_file
    weight = weights["Q4_1"]
    model = tmp_path / "linear.onnx"
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="linear")], "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "rows", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "rows", N])],
        [onnx.numpy_helper.from_array(weight, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), model)
    assert qdq.quantize_graph(model, GgufBlocks(path).lookup) == 1
    ops = [node.op_type for node in onnx.load(model).graph.node]
    assert ops == ["DequantizeLinear", "MatMul", "Reshape", "ReduceSum", "MatMul", "Add"]

    x = np.random.default_rng(2).standard_normal((1, 5, K)).astype(np.float32)
    exact = x.astype(np.float64) @ weight.astype(np.float64)
    for level, tolerance in (("0", 1e-5), ("4", 2e-2)):
        options = ort.SessionOptions()
        options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", level)
        options.optimized_model_filepath = str(tmp_path / f"optimized-{level}.onnx")
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(options.optimized_model_filepath).graph.node
        assert "MatMulNBits" in [node.op_type for node in optimized]
        y = session.run(None, {"x": x})[0]
        assert np.abs(y - exact).max() < tolerance * np.abs(exact).max(), level
        for rows in (2, 3, 4):
            assert np.array_equal(session.run(None, {"x": x[:, :rows]})[0], y[:, :rows]), (level, rows)


def test_layers_that_read_one_input_run_as_one_product(gguf_file, tmp_path):
    """Two Q4_1 layers of one input (a ``MatMul`` and a ``Gemm`` with a bias, as q / k / v or gate /
    up are) become one ``DequantizeLinear -> MatMul`` with their weights side by side, split after
    it, each output still its own layer's; a Q8_0 layer beside them, which one block type cannot
    hold, leaves each layer on its own."""
    from export.gguf_blocks import GgufBlocks

    path, weights = gguf_file
    bias = np.random.default_rng(3).standard_normal(N).astype(np.float32)
    layers = {"a": ("MatMul", weights["Q4_1"]), "b": ("Gemm", weights["Q4_1"][:, ::-1]),
              "c": ("MatMul", weights["Q8_0"])}
    x = np.random.default_rng(2).standard_normal((5, K)).astype(np.float32)
    for names, nodes_after in ((("a", "b"), {"DequantizeLinear": 1, "MatMul": 2, "Split": 1}),
                               (("a", "b", "c"), {"DequantizeLinear": 3, "MatMul": 5})):
        nodes, initializers = [], []
        for name in names:
            op, weight = layers[name]
            if op == "Gemm":
                nodes.append(helper.make_node("Gemm", ["x", f"w_{name}", "bias"], [name], transB=1))
                initializers += [onnx.numpy_helper.from_array(np.ascontiguousarray(weight.T), f"w_{name}"),
                                 onnx.numpy_helper.from_array(bias, "bias")]
            else:
                nodes.append(helper.make_node("MatMul", ["x", f"w_{name}"], [name]))
                initializers.append(onnx.numpy_helper.from_array(np.ascontiguousarray(weight), f"w_{name}"))
        graph = helper.make_graph(
            nodes, "layers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, K])],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, [5, N]) for n in names], initializers)
        model = tmp_path / f"{''.join(names)}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), model)
        assert qdq.quantize_graph(model, GgufBlocks(path).lookup) == len(names)
        ops = [node.op_type for node in onnx.load(model).graph.node]
        assert {op: ops.count(op) for op in nodes_after} == nodes_after, ops

        options = ort.SessionOptions()
        options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
        outputs = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"]).run(None, {"x": x})
        for name, y in zip(names, outputs):
            exact = x.astype(np.float64) @ layers[name][1].astype(np.float64) + (bias if name == "b" else 0)
            assert np.abs(y - exact).max() < 1e-5 * np.abs(exact).max(), name


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_an_embedding_gathers_the_files_rows_as_blocks_and_gives_their_values(gguf_file, tmp_path, kind):
    """With ``embeddings``, a ``Gather`` of a float table whose rows are the file's (a tied
    embedding: the output layer's rows) holds the rows' integers and scales instead, and gives
    exactly the values it gave; without, or for a table not in the file, it stays float."""
    from export.gguf_blocks import GgufBlocks

    path, weights = gguf_file
    table = np.ascontiguousarray(weights[kind].T)                    # [N, K]: a row per token
    ids = np.array([[3, 0, 47, 3], [9, 12, 1, 46]], np.int64)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0, name="embed")], "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, "tokens"])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [2, "tokens", K])],
        [onnx.numpy_helper.from_array(table, "table")])
    for embeddings, values in ((False, table), (True, table), (True, table + 1e-3)):
        model = tmp_path / "embedding.onnx"
        graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(values, "table"))
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), model)
        assert qdq.quantize_graph(model, GgufBlocks(path).lookup, embeddings=embeddings) == 0
        stored = {t.name: t.data_type for t in onnx.load(model).graph.initializer}
        kept = not embeddings or values is not table
        assert ("table" in stored) == kept and (stored.get("table_rows_q") == TensorProto.INT8) != kept
        rows = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
        assert np.array_equal(rows, values[ids])


@pytest.mark.parametrize("tied", [False, True])
def test_a_file_with_other_types_is_refused_before_any_model_is_loaded(tiny, tmp_path, tied):
    """A Q4_K_M-style file (matrices of types ``--weights gguf`` cannot keep) is refused from its
    header, naming the tensors; the token embeddings count only where they are the output layer."""
    import gguf

    from export import __main__ as cli
    from export.gguf_blocks import unsupported_matrices

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": "F16", "blk.0.attn_q.weight": "F16", "blk.0.ffn_up.weight": "Q8_0",
               "blk.0.attn_norm.weight": "F32", **({} if tied else {"output.weight": "Q8_0"})}
    for name, kind in tensors.items():
        shape = (K,) if name.endswith("norm.weight") else (N, K)
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), qtype),
                          raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = ["blk.0.attn_q.weight (F16)"] + (["token_embd.weight (F16)"] if tied else [])
    assert sorted(unsupported_matrices(path)) == expected
    _, draft = tiny()
    with pytest.raises(SystemExit) as refused:
        cli.main(["build", "--target", str(path), "--draft", str(draft), "--out", str(tmp_path / "e"),
                  "--weights", "gguf", "--quiet"])
    message = str(refused.value.code)
    assert message.startswith("error: --weights gguf: ") and "\n" not in message, message
    assert all(name in message for name in expected) and "use --weights int4 or int8" in message
    assert not (tmp_path / "e").exists()
