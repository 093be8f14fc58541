"""``build --weights gguf``: a GGUF file's own blocks (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K
/ Q6_K as they are, Q6_K experts rounded again to int8), found by a weight's values and written as
``DequantizeLinear -> MatMul`` (plus Q4_1's per-block offsets), which ONNX Runtime
runs as ``MatMulNBits`` computing with exactly the file's weights; a row's result does not depend on
how many rows share the call. The demo build with these weights: ``tests/graphs/test_gguf.py``."""
import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from export import qdq

pytestmark = [pytest.mark.slow,   # the real-model tier: builds engines or runs servers
              pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf extra")]

K, N = 256, 48   # K-quants' super-blocks are 256 wide
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16")
# where a K-quant block's fp16 scales lie (gguf-py cannot write these types: the blocks are random
# bytes, their scales made small enough that the values stay finite)
K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def raw_blocks(rng, kind: str, rows: int, columns: int, random: bool = False) -> np.ndarray:
    """A ``[rows, columns]`` weight of type ``kind`` as the file holds it (uint8 blocks): values
    quantized by gguf-py, or with ``random`` (a K-quant's always) random bytes under small scales."""
    import gguf
    from gguf.quants import quantize as gguf_quantize

    qtype = gguf.GGMLQuantizationType[kind]
    if kind not in K_SCALES and not random:
        # an offset per row, so that Q4_1's minimum is not Q4_0's -8 d
        return gguf_quantize((rng.standard_normal((rows, columns)) + rng.standard_normal((rows, 1)))
                             .astype(np.float32), qtype)
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, columns // values, size), dtype=np.uint8)
    for at in K_SCALES.get(kind, (0,)):   # the others' d leads each block
        scale = rng.uniform(1e-3, 4e-3, (rows, columns // values)).astype(np.float16)
        raw[..., at:at + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A GGUF file with one ``[N, K]`` weight per type (rows out, as llama.cpp stores them), and
    each weight's de-quantized values ``[K, N]``, as ``transformers`` gives them to the build."""
    import gguf
    from gguf.quants import dequantize

    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    weights = {}
    for kind in TYPES:
        qtype = gguf.GGMLQuantizationType[kind]
        raw = raw_blocks(rng, kind, N, K)
        writer.add_tensor(kind, raw, raw_dtype=qtype)
        weights[kind] = np.ascontiguousarray(dequantize(raw, qtype).T)
    qtype = gguf.GGMLQuantizationType.Q6_K   # a stack of 3 experts' [N, K] weights
    raw = raw_blocks(rng, "Q6_K", 3 * N, K)
    writer.add_tensor("Q6_K_experts", raw.reshape(3, N, -1), raw_dtype=qtype)
    weights["Q6_K_experts"] = np.ascontiguousarray(dequantize(raw, qtype).reshape(3, N, K).transpose(0, 2, 1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, weights


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_a_weight_is_found_by_its_values_in_any_row_order(gguf_file, kind):
    """Each type's blocks give the file's values (those with offsets to the last bit of the
    offset's rounding), in blocks of 32 of int4 (Q4_*) or int8 (Q6_K: of 16) that the kernel
    takes, a K-quant's with the integers its scales are made of."""
    from export.gguf_blocks import GgufBlocks
    from plugins.qmatmul.layout import supported

    path, weights = gguf_file
    blocks = GgufBlocks(path)
    order = np.random.default_rng(1).permutation(N)   # transformers permutes q / k projections' rows
    for matrix in (weights[kind], np.ascontiguousarray(weights[kind][:, order])):
        found = blocks.lookup(matrix)
        assert found.bits == (4 if kind.startswith("Q4") else 8)
        assert found.block == (16 if kind == "Q6_K" else 32)
        assert (found.kquant is not None) == kind.endswith("_K")
        assert (found.offsets is not None) == (kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"))
        assert supported(found.q, found.block, found.bits)
        assert -2 ** (found.bits - 1) <= found.q.min() and found.q.max() < 2 ** (found.bits - 1)
        if found.offsets is None:
            assert np.array_equal(found.values(), matrix)
        else:
            assert np.abs(found.values() - matrix).max() <= 1e-6 * np.abs(matrix).max()
        assert blocks.engine_values(matrix) is None   # the module keeps the file's values


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q6_K_experts"])
def test_a_weight_read_in_chunks_gives_the_same_blocks(gguf_file, monkeypatch, kind):
    """The file is indexed, and a weight looked up, some rows at a time (a vocabulary-sized
    weight's temporaries stay small): chunks that split the rows give the same blocks."""
    from export import gguf_blocks, quantize

    path, weights = gguf_file
    whole = gguf_blocks.GgufBlocks(path)
    matrix = weights[kind][1] if kind == "Q6_K_experts" else weights[kind]
    matrix = whole.engine_values(matrix) if kind == "Q6_K_experts" else matrix
    expected = whole.lookup(matrix)
    monkeypatch.setattr(quantize, "COLUMNS", 7)
    chunked = gguf_blocks.GgufBlocks(path)
    if kind == "Q6_K_experts":
        assert np.array_equal(chunked.engine_values(weights[kind][1]), matrix)
    found = chunked.lookup(matrix)
    for part in ("q", "scales", "offsets"):
        assert np.array_equal(getattr(found, part), getattr(expected, part)), part
    if kind != "Q6_K_experts":
        assert np.array_equal(found.kquant.sc, expected.kquant.sc)


def test_q6_k_experts_are_rounded_again_to_int8_blocks_of_32(gguf_file):
    """An expert's Q6_K sub-blocks of 16 fit no block of 32 of ``MoeExpertsInt8``: the engine
    computes with its values rounded to int8 (within half a step, 1/254 of a block's largest
    magnitude), which ``engine_values`` gives the module first; those values are then found, and
    their blocks give them exactly. A 2-D Q6_K weight keeps the file's values."""
    from export.gguf_blocks import GgufBlocks

    path, weights = gguf_file
    blocks, matrix = GgufBlocks(path), weights["Q6_K_experts"][2]
    assert blocks.engine_values(weights["Q6_K"]) is None
    rounded = blocks.engine_values(matrix)
    largest = np.repeat(np.abs(matrix).reshape(K // 32, 32, N).max(axis=1), 32, axis=0)
    assert 0 < np.abs(rounded - matrix).max() and np.all(np.abs(rounded - matrix) <= largest / 254 * 1.0001)
    with pytest.raises(ValueError, match="do not reproduce its values"):
        blocks.lookup(matrix)                      # the file's values: the build rounds them first
    found = blocks.lookup(rounded)
    assert (found.bits, found.block, found.offsets) == (8, 32, None) and found.q.min() >= -127
    assert np.array_equal(found.values(), rounded)


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


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K"])
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
        lookup = GgufBlocks(path).lookup
        assert qdq.quantize_graph(model, lookup, embeddings=lookup if embeddings else None) == 0
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


def _k_quant_pair(directory, kinds: dict[str, str], layers: int = 3, hidden: int = 256, width: int = 512,
                  others: str = "Q8_0", random: bool = False):
    """A Qwen3 GGUF target ``hidden`` wide (a multiple of 256: K-quants' rows are super-blocks of
    256) whose matrices are random blocks of ``kinds[name]`` (llama.cpp's tensor names without
    ``blk.N.``; others ``others``; with ``random``, random bytes, quick to make, as a K-quant's
    always are), with the tiny pair's vocabulary, and a random draft for it: ``(target, draft)``."""
    import gguf

    from modeling.fixtures.tiny import SPECIALS, TinySpec, _tokenizer, write_draft

    # transformers reads no head size from a qwen3 file: its default, 128
    heads, head_dim = 2, 128
    tokens = list(_tokenizer().get_vocab())
    tokens.sort(key=_tokenizer().get_vocab().get)
    writer = gguf.GGUFWriter(directory / "target.gguf", "qwen3")
    for add, value in (("block_count", layers), ("context_length", 256), ("embedding_length", hidden),
                       ("feed_forward_length", width), ("head_count", heads), ("head_count_kv", 1),
                       ("key_length", head_dim), ("value_length", head_dim), ("rope_freq_base", 1e4),
                       ("layer_norm_rms_eps", 1e-6)):
        getattr(writer, f"add_{add}")(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    rng = np.random.default_rng(4)
    shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (head_dim, hidden),
              "attn_v": (head_dim, hidden), "attn_output": (hidden, heads * head_dim),
              "ffn_gate": (width, hidden), "ffn_up": (width, hidden), "ffn_down": (hidden, width)}

    def matrix(name: str, shape: tuple[int, int]) -> None:
        kind = kinds.get(name.split(".")[-2], others)
        writer.add_tensor(name, raw_blocks(rng, kind, *shape, random=random),
                          raw_dtype=gguf.GGMLQuantizationType[kind])

    matrix("token_embd.weight", (len(tokens), hidden))   # tied: the output layer too
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
    for layer in range(layers):
        for name, shape in shapes.items():
            matrix(f"blk.{layer}.{name}.weight", shape)
        for norm, size in (("attn_norm", hidden), ("ffn_norm", hidden), ("attn_q_norm", head_dim),
                           ("attn_k_norm", head_dim)):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", rng.uniform(0.5, 1.5, size).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = dict(vocab_size=len(tokens), hidden_size=hidden, intermediate_size=width,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1,
                  head_dim=head_dim, max_position_embeddings=256, rope_theta=1e4, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    write_draft(directory / "draft", config, TinySpec(taps=(0, 1)))
    return directory / "target.gguf", directory / "draft"


def test_a_q4_k_m_style_target_builds_keeping_its_blocks(tmp_path, monkeypatch):
    """A target as llama-quantize's Q4_K_M writes one (Q4_K matrices, Q6_K for the tied embedding /
    output, v and down projections; Q5_K in place of some) builds with ``--weights gguf`` by
    default: verified against the file's own model, every matrix int4 / int8 blocks with the file's
    integer scales, and speculative output equal to target-only output. Each graph is written
    once, as the engine holds it: its weights never reach the disk as floats (an 8B target's were
    32.8 GB of float32, written to be read back once)."""
    import json

    import export.build
    from export import __main__ as cli

    written, export_graph = {}, export.build.export_graph

    def noting_the_size(*args, **options):
        path = export_graph(*args, **options)
        written[path.name] = (path.parent / f"{path.name}.data").stat().st_size
        return path

    monkeypatch.setattr(export.build, "export_graph", noting_the_size)

    from oracles import check_speculative_equals_target_only

    target, draft = _k_quant_pair(tmp_path, {"token_embd": "Q6_K", "attn_v": "Q6_K", "ffn_down": "Q6_K",
                                             "attn_output": "Q5_K", "ffn_up": "Q4_K", "ffn_gate": "Q4_K",
                                             "attn_q": "Q4_K", "attn_k": "Q4_K"})
    engine = tmp_path / "engine"
    cli.main(["build", "--target", str(target), "--draft", str(draft), "--out", str(engine),
              "--max-batch", "3", "--max-seq-len", "96", "--quiet"])
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["weights"]["target"] == "gguf"
    assert manifest["weights"]["quality"] is None   # the rounding's cost: docs/usage.md states it
    graph = onnx.load(engine / "target.onnx", load_external_data=False).graph
    types = {i.name: i.data_type for i in graph.initializer}
    floats = [name for name, t in types.items() if t == TensorProto.FLOAT and name.endswith("proj.weight")]
    assert not floats
    assert TensorProto.INT4 in types.values() and TensorProto.INT8 in types.values()
    # every layer's scales and offsets are the file's integers, not float32 tables: per layer q, k
    # (Q6_K's v fuses with neither), v, the output, the fused gate / up and the down projection,
    # and the lm_head (the tied Q6_K embedding); Q4_K's and Q5_K's uint8, Q6_K's int8
    kquant = [name for name in types if name.endswith("_sc")]
    assert len(kquant) == 6 * 3 + 1
    assert sorted(types[name] for name in kquant) == [TensorProto.UINT8] * 12 + [TensorProto.INT8] * 7
    assert not [name for name in types if name.endswith("_offsets")]
    assert max(_dequantized_ahead(engine / "target.onnx", tmp_path).values()) <= 8
    assert written == {name: (engine / f"{name}.data").stat().st_size
                       for name in ("draft.onnx", "target.onnx")}
    check_speculative_equals_target_only(engine)


def _dequantized_ahead(path, tmp_path) -> dict[str, int]:
    """How many nodes before its last reader each ``DequantizeLinear`` of the graph at ``path``
    runs, in ONNX Runtime's order of a verification run (``onnx_check``), on zero inputs: a weight
    de-quantized far ahead of its product is held in float32 meanwhile (at 8B, 6.4 GB of them)."""
    import json

    import onnxruntime as ort

    from export.onnx_check import _options

    options = _options("float32")
    options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "profile")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = {}
    for given in session.get_inputs():
        shape = [1 if isinstance(size, str) else size for size in given.shape]
        feeds[given.name] = np.zeros(shape, np.int64 if "int64" in given.type else np.float32)
    session.run(None, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    order = [e["name"].removesuffix("_kernel_time") for e in events
             if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    at = {name: index for index, name in enumerate(order)}
    readers = {}
    graph = onnx.load(path, load_external_data=False).graph
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.name)
    return {node.name: max(at[reader] for reader in readers[node.output[0]]) - at[node.name]
            for node in graph.node if node.op_type == "DequantizeLinear" and node.name in at}


def test_a_gguf_targets_weights_are_read_from_the_file_a_few_at_a_time(tmp_path, monkeypatch):
    """A build traces a GGUF target on placeholders and reads each weight from the file as the
    graph is written or as its layer runs (``modeling/lazy_weights.py``): the weights are those
    ``transformers`` loads, the reference is the module's own, and no step holds more than one
    layer's weights de-quantized beside the rest (the optimizer kept a transposed copy of every
    weight until the graph was written: the whole model, 32 GB for an 8B file)."""
    import weakref
    from collections import Counter

    import torch

    from export.onnx_export import BuildLimits, export_graph, target_spec
    from export.verify_inputs import example_inputs, reference_outputs
    from modeling.lazy_weights import resident
    from modeling.target import load_target, load_target_lazily

    target, _ = _k_quant_pair(tmp_path, {"ffn_up": "Q4_K", "attn_v": "Q6_K"})
    module, weights = load_target_lazily(target, taps=(0, 1))
    whole = load_target(target, taps=(0, 1))
    assert weights is not None
    assert all(p.stride() == (0,) * p.dim() for p in module.parameters())   # placeholders
    for name, parameter in whole.named_parameters():
        assert torch.equal(weights.load(name), parameter), name

    read, held = weights.load, []   # how many weights read from the file are alive at each read
    alive: list[weakref.ref] = []
    reads = Counter()

    def counted(name: str) -> torch.Tensor:
        values = read(name).numpy().copy()
        reads[name] += 1
        alive.append(weakref.ref(values))
        held.append(sum(ref() is not None for ref in alive))
        return torch.from_numpy(values)

    monkeypatch.setattr(weights, "load", counted)
    limits = BuildLimits(2, 64, 8)
    spec = target_spec(module, limits, slots=3)
    trace, verify = example_inputs(spec, limits, module.config.vocab_size, 4,
                                   torch.Generator().manual_seed(0))
    export_graph(module, spec, trace, limits, tmp_path, 23, weights=weights)
    # each matrix read once, as the graph is written (the optimizer's rewrites read the norms too)
    assert {reads[name] for name, shape in weights.shapes.items() if len(shape) == 2} == {1}
    assert max(held) <= 2, held

    held.clear()
    with resident(module, weights):
        outputs = reference_outputs(module, verify)
    layer = len(list(module.layers[0].parameters()))
    rest = len(list(module.parameters())) - layer * len(module.layers)
    assert max(held) <= rest + layer, held
    assert all(p.stride() == (0,) * p.dim() for p in module.parameters())   # let go after
    for got, expected in zip(outputs, reference_outputs(whole, verify)):
        assert torch.equal(got, expected)
