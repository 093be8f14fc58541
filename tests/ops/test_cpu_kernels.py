"""The compiled CPU kernels (``plugins/cpu``): the quantized weight products (``plugins/qmatmul``)
and the batched causal attention (``plugins/block_attention/cpu_kernel.cpp``): what they compute,
a row's result whatever rows share its call, their ONNX Runtime ops and lowerings, and the
build's fallback where no compiler is found."""
import ctypes

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from plugins.block_attention.reference import block_attention
from plugins.cpu import build
from plugins.ort_session import lowered_session
from plugins.qmatmul import layout
from plugins.qmatmul.ort_lowering import DOMAIN, OP

LIBRARY = build.library()
needs_kernel = pytest.mark.skipif(LIBRARY is None, reason="no compiler or no AVX2: the stock path runs")

# (bits, offsets, K, N): the demo target's layer kinds, a narrow layer, a width not a multiple of 16,
# int8 with offsets (GGUF Q5_1 / Q5_K)
SHAPES = [(4, False, 576, 960), (4, True, 576, 200), (8, False, 1536, 576), (8, False, 64, 17),
          (4, True, 96, 40), (8, True, 256, 40)]


class _Weight(ctypes.Structure):
    _fields_ = [("bits", ctypes.c_int32), ("K", ctypes.c_int32), ("N", ctypes.c_int32),
                ("q", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("wsums", ctypes.c_void_p), ("sub", ctypes.c_void_p), ("super", ctypes.c_void_p),
                ("middle", ctypes.c_float)]


def _kernel():
    lib = ctypes.CDLL(str(LIBRARY))
    lib.dspark_qmatmul_scratch.restype = ctypes.c_int64
    lib.dspark_qmatmul_scratch.argtypes = [ctypes.c_int64] * 2
    lib.dspark_qmatmul_quantize.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.dspark_qmatmul_tiles.argtypes = [ctypes.POINTER(_Weight), ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    return lib


def _run(lib, x: np.ndarray, packed: layout.Packed, splits=(1,)) -> np.ndarray:
    """The kernel on ``x [M, K]``, its tiles in ``len(splits)`` calls of the given shares."""
    rows, k = x.shape
    pointer = lambda a: a.ctypes.data if a.size else None   # noqa: E731
    weight = _Weight(packed.bits, k, packed.n, pointer(packed.q), pointer(packed.scales),
                     pointer(packed.offsets), pointer(packed.sums), pointer(packed.sub),
                     pointer(packed.super), packed.middle)
    scratch = np.empty(lib.dspark_qmatmul_scratch(rows, k), np.uint8)
    y = np.full((rows, packed.n), np.nan, np.float32)
    x = np.ascontiguousarray(x, np.float32)
    lib.dspark_qmatmul_quantize(x.ctypes.data, rows, k, scratch.ctypes.data)
    for first, last in _shares(packed.q.shape[0], splits):
        lib.dspark_qmatmul_tiles(ctypes.byref(weight), scratch.ctypes.data, rows, y.ctypes.data, first, last)
    return y


def _shares(tiles: int, splits) -> list[tuple[int, int]]:
    """``[first, last)`` ranges of ``tiles`` in the proportions ``splits`` (as threads take them)."""
    bounds = np.round(np.cumsum([0, *splits]) / sum(splits) * tiles).astype(int)
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))


def _weight(rng, bits, offsets, k, n):
    low, high = (-8, 8) if bits == 4 else (-127, 128)
    q = rng.integers(low, high, (k, n)).astype(np.int8)
    scales = (rng.random((k // 32, n)) * 0.02).astype(np.float32)
    return q, scales, (rng.standard_normal((k // 32, n)) * 0.01).astype(np.float32) if offsets else None


@needs_kernel
@pytest.mark.parametrize("bits, offsets, k, n", SHAPES)
def test_the_kernel_computes_the_blocks_integer_products_and_a_row_alone_as_in_any_call(bits, offsets, k, n):
    """Against ``layout.reference`` (float64) within float32 rounding; near the de-quantized
    float product (int8 activations); and each row's values bit for bit the same alone, in a call
    of 9 rows, and with the tiles split between calls (threads)."""
    rng = np.random.default_rng(bits * 1000 + k + n)
    lib = _kernel()
    q, scales, offs = _weight(rng, bits, offsets, k, n)
    packed = layout.pack(q, scales, bits, offs)
    x = rng.standard_normal((9, k)).astype(np.float32)
    x[3] = 0   # a zero block: scale 0
    y = _run(lib, x, packed)
    reference = layout.reference(x, q, scales, offs)
    np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    weight = q.astype(np.float32) * np.repeat(scales, 32, 0) + (0 if offs is None else np.repeat(offs, 32, 0))
    exact = x @ weight
    assert np.abs(y - exact).max() < 0.02 * np.abs(exact).max()
    alone = np.stack([_run(lib, x[i:i + 1], packed)[0] for i in range(len(x))])
    assert np.array_equal(alone, y)
    assert np.array_equal(_run(lib, x[2:7], packed, splits=(1, 3, 2)), y[2:7])


def _k_quant(rng, bits, k, n) -> tuple[np.ndarray, layout.KQuantScales]:
    """A Q4_K (4 bits) or Q5_K (8 bits) weight as ``gguf_blocks.decode`` gives it: the file's
    unsigned integers shifted by ``middle``, and its 6-bit scales and minimums under fp16 ones."""
    middle = 8 if bits == 4 else 16
    q = (rng.integers(0, 2 * middle, (k, n)) - middle).astype(np.int8)
    half = lambda: (rng.random((k // 256, n)) * 1e-3).astype(np.float16).astype(np.float32)  # noqa: E731
    six = lambda: rng.integers(0, 64, (k // 32, n)).astype(np.uint8)  # noqa: E731
    return q, layout.KQuantScales(six(), six(), half(), half(), middle)


@needs_kernel
@pytest.mark.parametrize("bits, k, n", [(4, 512, 200), (8, 768, 40), (4, 2560, 17)])
def test_a_k_quant_computes_the_bits_of_its_float_scales_and_offsets(bits, k, n):
    """A K-quant packed with its 6-bit integers (4.625 bits a weight at 4 bits) gives every row
    the same bits as with the float32 scales and offsets they make (6 bits a weight), alone and
    in any call, and its scales and offsets are exactly ``gguf_blocks.decode``'s."""
    rng = np.random.default_rng(bits + k + n)
    lib = _kernel()
    q, kquant = _k_quant(rng, bits, k, n)
    scales, offsets = kquant.scales(), kquant.offsets()
    compact, plain = layout.pack(q, kquant, bits), layout.pack(q, scales, bits, offsets)
    x = rng.standard_normal((9, k)).astype(np.float32)
    y = _run(lib, x, compact)
    assert np.array_equal(y, _run(lib, x, plain))
    np.testing.assert_allclose(y, layout.reference(x, q, scales, offsets), rtol=1e-5,
                               atol=1e-5 * np.abs(y).max())
    assert np.array_equal(_run(lib, x[4:5], compact)[0], y[4])
    assert np.array_equal(_run(lib, x[1:8], compact, splits=(2, 1)), y[1:8])
    size = lambda p: sum(a.nbytes for a in (p.q, p.scales, p.offsets, p.sums, p.sub, p.super))  # noqa: E731
    assert size(compact) < (0.8 if bits == 4 else 0.9) * size(plain)


def _q6_k(rng, k, n) -> tuple[np.ndarray, layout.KQuantScales]:
    """A Q6_K weight as ``gguf_blocks.decode`` gives it: values -32..31, an int8 scale per 16 under
    an fp16 one per 256."""
    q = rng.integers(-32, 32, (k, n)).astype(np.int8)
    sc = rng.integers(-128, 128, (k // 16, n)).astype(np.int8)
    d = (rng.random((k // 256, n)) * 1e-3).astype(np.float16).astype(np.float32)
    return q, layout.KQuantScales(sc, None, d, None, 32)


@needs_kernel
@pytest.mark.parametrize("k, n", [(512, 200), (2560, 17)])
def test_a_q6_k_weight_is_six_bits_with_a_scale_per_half_block(k, n):
    """Q6_K packed as 6 bits and its own scales (6.5625 bits a weight): each half block's exact
    integer product times its scale, against ``layout.reference`` within float32 rounding, and
    each row the same bits alone and in any call."""
    rng = np.random.default_rng(k + n)
    lib = _kernel()
    q, kquant = _q6_k(rng, k, n)
    packed = layout.pack(q, kquant, 6)
    assert packed.q.shape[-1] == 6 * 64 and layout.supported(q, 16, 8)
    x = rng.standard_normal((9, k)).astype(np.float32)
    x[5] = 0
    y = _run(lib, x, packed)
    reference = layout.reference(x, q, kquant.scales())
    np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    exact = x @ (q.astype(np.float32) * np.repeat(kquant.scales(), 16, 0))
    assert np.abs(y - exact).max() < 0.02 * np.abs(exact).max()
    alone = np.stack([_run(lib, x[i:i + 1], packed)[0] for i in range(len(x))])
    assert np.array_equal(alone, y)
    assert np.array_equal(_run(lib, x[2:9], packed, splits=(1, 2)), y[2:9])


@pytest.mark.parametrize("form", ["int4", "int8-offsets", "q4_k", "q6_k"])
def test_a_weight_packed_some_columns_at_a_time_is_the_same_bytes(monkeypatch, form):
    """``pack`` makes a wide weight (a vocabulary's ``lm_head``) a few tiles of columns at a time,
    each into its place: the same arrays as in one piece, the last tile's padding included."""
    rng = np.random.default_rng(7)
    k, n = 512, 16 * 9 + 5
    if form == "q4_k":
        q, scales = _k_quant(rng, 4, k, n)
        args = (q, scales, 4)
    elif form == "q6_k":
        q, scales = _q6_k(rng, k, n)
        args = (q, scales, 6)
    else:
        bits = 4 if form == "int4" else 8
        q, scales, offsets = _weight(rng, bits, form.endswith("offsets"), k, n)
        args = (q, scales, bits, offsets)
    whole = layout.pack(*args)
    monkeypatch.setattr(layout, "PACKED_AT_ONCE", 2 * 16 * k)   # 2 tiles a piece: 5 pieces
    pieces = layout.pack(*args)
    for field in ("q", "scales", "offsets", "sums", "sub", "super"):
        a, b = getattr(whole, field), getattr(pieces, field)
        assert a.dtype == b.dtype and np.array_equal(a, b), field
    assert (whole.n, whole.bits, whole.middle) == (pieces.n, pieces.bits, pieces.middle)


@needs_kernel
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("k, n", [(576, 960), (63, 17)])
def test_the_float_kernel_sums_in_one_order_per_row(k, n, dtype):
    """``FMatMul`` (float32 weights) and ``HMatMul`` (fp16 weights, kept in fp16, and an fp16
    output): x's rows within the output type's rounding of float64, and each row's values the
    same bits alone, in a call of 9 rows and with the tiles split (an odd K too)."""
    lib = _kernel()
    half = dtype == np.float16
    tiles = lib.dspark_hmatmul_tiles if half else lib.dspark_fmatmul_tiles
    tiles.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                      ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    rng = np.random.default_rng(k)
    weight = rng.standard_normal((k, n)).astype(dtype)
    packed = layout.pack_float(weight)
    assert packed.dtype == dtype and np.array_equal(layout.pack_float(np.ascontiguousarray(weight.T), True),
                                                    packed)

    def run(x, splits=(1,)):
        y = np.full((len(x), n), np.nan, dtype)
        x = np.ascontiguousarray(x, np.float32)
        for first, last in _shares(len(packed), splits):
            tiles(packed.ctypes.data, k, n, x.ctypes.data, len(x), y.ctypes.data, first, last)
        return y

    x = rng.standard_normal((9, k)).astype(dtype)
    y = run(x)
    exact = x.astype(np.float64) @ weight.astype(np.float64)
    rtol = 1e-3 if half else 1e-4   # fp16's rounding of the output: 2^-11
    np.testing.assert_allclose(y, exact, rtol=rtol, atol=rtol * np.abs(exact).max())
    assert np.array_equal(np.stack([run(x[i:i + 1])[0] for i in range(9)]), y)
    assert np.array_equal(run(x[1:8], splits=(2, 1)), y[1:8])


def test_int8_weights_of_minus_128_are_left_to_the_stock_kernels():
    """The AVX2 path puts x's sign on the weight, which -128 would overflow: such a weight is not
    taken (llama.cpp's Q8_0 and our RTN never write -128)."""
    q = np.zeros((32, 16), np.int8)
    assert layout.supported(q, 32, 8)
    q[0, 0] = -128
    assert not layout.supported(q, 32, 8) and layout.supported(q.clip(-8, 7), 32, 4)
    assert not layout.supported(np.zeros((64, 16), np.int8), 64, 4)   # blocks of 64


def _linear_graph(path, q, scales, offsets, bits):
    """``y = x @ DequantizeLinear(q, scales) [+ block sums of x @ offsets]`` as ``export/qdq.py``
    writes it (a K-quant's scales and offsets made by its ``_kquant_scales``), x ``[batch, rows,
    K]``, saved at ``path``."""
    import ml_dtypes

    from export.qdq import _kquant_scales

    k, n = q.shape
    x = ir.Value(name="x", shape=ir.Shape(["batch", "rows", k]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 23}, name="linear")

    def constant(name, array):
        value = ir.Value(name=name, const_value=ir.Tensor(array, name=name))
        graph.register_initializer(value)
        return value

    nodes, block = [], 32
    if isinstance(scales, layout.KQuantScales):
        block = k // len(scales.sc) if scales.m is None else 32   # Q6_K's half blocks
        scales, offsets = _kquant_scales(graph, "w", scales, nodes)
    else:
        scales = constant("w_scales", scales)
        offsets = None if offsets is None else constant("w_offsets", offsets)
    dq = ir.node("DequantizeLinear", [constant("w_q", q.astype(ml_dtypes.int4) if bits == 4 else q), scales],
                 attributes={"axis": 0, "block_size": block})
    matmul = ir.node("MatMul", [x, dq.outputs[0]])
    nodes, y = nodes + [dq, matmul], matmul.outputs[0]
    if offsets is not None:
        blocks = ir.node("Reshape", [x, constant("shape", np.array([0, 0, -1, 32], np.int64))])
        sums = ir.node("ReduceSum", [blocks.outputs[0], constant("axis", np.array([-1], np.int64))],
                       attributes={"keepdims": 0})
        offset = ir.node("MatMul", [sums.outputs[0], offsets])
        add = ir.node("Add", [y, offset.outputs[0]])
        nodes, y = nodes + [blocks, sums, offset, add], add.outputs[0]
    graph.extend(nodes)
    y.name = "y"
    graph.outputs.append(y)
    ir.save(ir.Model(graph, ir_version=10), path)


@needs_kernel
@pytest.mark.parametrize("bits, offsets", [(4, False), (4, True), (8, False), (8, True), (4, "K"), (8, "K"),
                                          (8, "Q6_K")])
def test_onnx_runtime_runs_the_lowered_layer_as_the_kernel_computes_it(tmp_path, bits, offsets):
    """A linear layer in the engine's form, loaded with the kernel: one ``QMatMul`` node (the
    offsets' block sums folded into it; a K-quant's scales and offsets read as the integers they
    are made of, Q6_K's values as 6 bits) giving the reference's values for ``[batch, rows, K]``
    input, and the stock session (ONNX Runtime's own kernels) within int8 activations' error."""
    rng = np.random.default_rng(bits + len(str(offsets)))
    k = 96 if offsets in (False, True) else 512
    if offsets in ("K", "Q6_K"):
        q, kquant = _k_quant(rng, bits, k, 40) if offsets == "K" else _q6_k(rng, k, 40)
        scales, offs, written = kquant.scales(), kquant.offsets(), kquant
    else:
        q, scales, offs = _weight(rng, bits, offsets, k, 40)
        written = scales
    path = tmp_path / "linear.onnx"
    _linear_graph(path, q, written, offs, bits)
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    session = lowered_session(path, ort.SessionOptions(), kernel=LIBRARY)
    y = session.run(None, {"x": x})[0]
    reference = layout.reference(x.reshape(6, k), q, scales, offs).reshape(2, 3, 40)
    np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())
    stock = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.abs(y - stock).max() < 0.02 * np.abs(stock).max()
    model = ir.load(path)
    from plugins.qmatmul.ort_lowering import lower
    packed = lower(model, path.name)
    assert [(n.domain, n.op_type) for n in model.graph] == [(DOMAIN, OP)]
    kquant = offsets in ("K", "Q6_K")
    scaled_by = ["sub", "super"] if kquant else ["scales"] + ["offsets"] * bool(offsets)
    assert {name.rsplit("_", 1)[1] for name, array in packed.items() if array.size} == {
        "q", *scaled_by, *["sums"] * (bits == 8 and offsets != "Q6_K")}


def test_without_a_compiler_the_build_says_so_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    assert build.build() is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no C++ compiler" in err and "stock kernels" in err


class _Attention(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("B", "R", "heads", "kv_heads", "D", "P", "C")] + \
        [("scale", ctypes.c_float)] + \
        [(name, ctypes.c_void_p) for name in ("q", "k_new", "v_new", "k_cache", "v_cache", "start", "slots",
                                               "out")] + \
        [("causal", ctypes.c_int64)]


def _attend(lib, q, k_new, v_new, k_cache, v_cache, start, slots, scale, causal=True):
    """The kernel's three phases as ``ort_ops.cpp`` runs them (heads in reverse order: any order of
    the tasks gives the same); returns ``out`` and writes the caches in place."""
    out = np.full_like(q, np.nan)
    arrays = [q, k_new, v_new, k_cache, v_cache, start, slots, out]
    call = _Attention(q.shape[0], q.shape[2], q.shape[1], k_new.shape[1], q.shape[3], k_cache.shape[0],
                      k_cache.shape[2], scale, *(a.ctypes.data for a in arrays), int(causal))
    lib.dspark_attention_check.restype = ctypes.c_char_p
    lib.dspark_attention_scratch.restype = ctypes.c_int64
    lib.dspark_attention_head.argtypes = [ctypes.POINTER(_Attention), ctypes.c_int64, ctypes.c_void_p]
    assert lib.dspark_attention_check(ctypes.byref(call)) is None
    lib.dspark_attention_write(ctypes.byref(call))
    scratch = np.empty(lib.dspark_attention_scratch(ctypes.byref(call)) // 4, np.float32)
    for task in reversed(range(q.shape[0] * q.shape[1])):
        lib.dspark_attention_head(ctypes.byref(call), task, scratch.ctypes.data)
    return out


@needs_kernel
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "draft-block"])
def test_the_attention_kernel_is_block_attention_and_a_row_its_own(causal):
    """Against ``reference.py`` (causal: the target's; not: the draft's block) on a pool of 3
    slots, the batch on slots 2 and 0 with other starts: the output and the caches each
    sequence's slot gets; and a sequence's output the same bits alone as beside another, whatever
    their lengths."""
    rng = np.random.default_rng(0)
    heads, kv_heads, d, capacity, rows = 6, 2, 32, 40, 5
    q = rng.standard_normal((2, heads, rows, d)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((2, kv_heads, rows, d)).astype(np.float32) for _ in range(2))
    pool = [rng.standard_normal((3, kv_heads, capacity, d)).astype(np.float32) for _ in range(2)]
    start, slots = np.array([7, 30], np.int64), np.array([2, 0], np.int64)
    lib = ctypes.CDLL(str(LIBRARY))
    k_pool, v_pool = (p.copy() for p in pool)
    out = _attend(lib, q, k_new, v_new, k_pool, v_pool, start, slots, 0.2, causal)
    for b, slot in enumerate(slots):
        expected = block_attention(*(torch.from_numpy(a[b:b + 1]) for a in (q, k_new, v_new)),
                                   *(torch.from_numpy(p[slot:slot + 1]) for p in pool),
                                   torch.from_numpy(start[b:b + 1]), causal=causal, scale=0.2)
        np.testing.assert_allclose(out[b], expected[0][0].numpy(), rtol=1e-5, atol=1e-5)
        written = slice(0, start[b] + rows)   # rows past a sequence's end are scratch
        np.testing.assert_array_equal(k_pool[slot, :, written], expected[1][0, :, written].numpy())
        np.testing.assert_array_equal(v_pool[slot, :, written], expected[2][0, :, written].numpy())
    np.testing.assert_array_equal(k_pool[1], pool[0][1])   # the slot no sequence ran on
    for b in range(2):
        alone = _attend(lib, q[b:b + 1], k_new[b:b + 1], v_new[b:b + 1], pool[0].copy(), pool[1].copy(),
                        start[b:b + 1], slots[b:b + 1], 0.2, causal)
        assert np.array_equal(alone[0], out[b])


@needs_kernel
@pytest.mark.parametrize("rows, head_dim, start", [(5, 32, 21), (5, 32, 27), (7, 128, 25), (2, 32, 23)])
def test_a_causal_row_is_the_bits_it_is_in_a_call_of_its_own(rows, head_dim, start):
    """A head's rows are attended up to five at a time (each key and value loaded once for them):
    row i of a call (5 rows: one group; 7: four and three; 2: two) is the same bits as that row in
    a one-row call at start + i, as a verify block's rows must equal target-only steps'. Keys past
    a group of 16, a group's last keys ending on a multiple of 16 (start 27 and 25: 32 keys) and a
    head size past 64 floats take the kernel's edges."""
    rng = np.random.default_rng(rows)
    heads, kv_heads, capacity = 4, 2, 64
    q = rng.standard_normal((1, heads, rows, head_dim)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((1, kv_heads, rows, head_dim)).astype(np.float32) for _ in range(2))
    pool = [rng.standard_normal((1, kv_heads, capacity, head_dim)).astype(np.float32) for _ in range(2)]
    lib = ctypes.CDLL(str(LIBRARY))
    at = np.array([start], np.int64), np.array([0], np.int64)
    out = _attend(lib, q, k_new, v_new, *(c.copy() for c in pool), *at, 0.125)
    for i in range(rows):
        caches = [c.copy() for c in pool]
        for cache, new in zip(caches, (k_new, v_new)):
            cache[0, :, start:start + i] = new[0, :, :i]   # the rows before it, as earlier steps left them
        one = [np.ascontiguousarray(a[:, :, i:i + 1]) for a in (q, k_new, v_new)]
        alone = _attend(lib, *one, *caches, np.array([start + i], np.int64), at[1], 0.125)
        assert np.array_equal(alone[0, :, 0], out[0, :, i]), i


def _fp16_graph(path, table: np.ndarray, weight: np.ndarray):
    """An fp16 decoder's ends, its weights in a file beside it: ``h = table[concat(a, b)] * 2``,
    ``y = h @ weight`` and ``logits = y @ table^T`` (tied embeddings), saved at ``path``."""
    f16 = ir.TensorType(ir.DataType.FLOAT16)
    ids_type = ir.TensorType(ir.DataType.INT64)
    a, b = (ir.Value(name=n, shape=ir.Shape([1, "rows"]), type=ids_type) for n in "ab")
    graph = ir.Graph([a, b], [], nodes=[], opset_imports={"": 23}, name="fp16")

    def constant(name, array):
        value = ir.Value(name=name, const_value=ir.Tensor(array, name=name))
        graph.register_initializer(value)
        return value

    ids = ir.node("Concat", [a, b], attributes={"axis": 1})
    rows = ir.node("Gather", [constant("table", table), ids.outputs[0]])
    scaled = ir.node("Mul", [rows.outputs[0], constant("scale", np.array(2, np.float16))])
    y = ir.node("MatMul", [scaled.outputs[0], constant("weight", weight)])
    transposed = ir.node("Transpose", [graph.initializers["table"]], attributes={"perm": [1, 0]})
    logits = ir.node("MatMul", [y.outputs[0], transposed.outputs[0]])
    graph.extend([ids, rows, scaled, y, transposed, logits])
    ids.outputs[0].type = a.type
    for node in (rows, scaled, y, transposed, logits):
        node.outputs[0].type = f16
    for node, name in ((y, "y"), (logits, "logits")):
        node.outputs[0].name = name
        graph.outputs.append(node.outputs[0])
    ir.save(ir.Model(graph, ir_version=10), path, external_data=f"{path.name}.data")


@needs_kernel
def test_an_fp16_graph_keeps_its_weights_in_fp16(tmp_path):
    """An fp16 engine's products run on ``HMatMul``, their weights packed in fp16 and given to
    ONNX Runtime in place, and its embeddings stay the fp16 table mapped from the file. ONNX
    Runtime's own way holds a float32 copy of each (its fp16 ``MatMul`` runs in float32, and a
    ``Gather`` of computed indices beside float32 ops too): twice the weights."""
    rng = np.random.default_rng(16)
    table = rng.standard_normal((96, 64)).astype(np.float16)
    weight = (rng.standard_normal((64, 64)) / 8).astype(np.float16)
    path = tmp_path / "fp16.onnx"
    _fp16_graph(path, table, weight)
    feeds = {"a": np.array([[5, 7]]), "b": np.array([[95, 0, 3]])}

    def session(kernel):
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / f"optimized-{kernel is not None}.onnx")
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                         f"optimized-{kernel is not None}.data")
        if kernel is None:
            return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]), options
        return lowered_session(path, options, kernel=kernel), options

    def float32_weights(options):
        model = ir.load(options.optimized_model_filepath)
        return sorted(name for name, value in model.graph.initializers.items()
                      if value.const_value.dtype == ir.DataType.FLOAT and value.const_value.size > 1)

    stock, stock_options = session(None)
    ours, options = session(LIBRARY)
    assert float32_weights(stock_options)   # the copies this avoids
    assert float32_weights(options) == []
    ops = {node.op_type for node in ir.load(options.optimized_model_filepath).graph}
    assert "HMatMul" in ops and "MatMul" not in ops
    y, logits = ours.run(["y", "logits"], feeds)
    h = table[[5, 7, 95, 0, 3]].astype(np.float64) * 2
    expected_y = (h @ weight.astype(np.float64)).astype(np.float16)
    np.testing.assert_allclose(y[0], expected_y, rtol=1e-3, atol=1e-3)
    expected = y[0].astype(np.float64) @ table.astype(np.float64).T
    np.testing.assert_allclose(logits[0], expected, rtol=2e-3, atol=2e-3 * np.abs(expected).max())
    stock_y, stock_logits = stock.run(["y", "logits"], feeds)
    np.testing.assert_allclose(logits, stock_logits, rtol=2e-2, atol=2e-2 * np.abs(stock_logits).max())
