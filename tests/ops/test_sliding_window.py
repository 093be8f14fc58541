"""``dspark::BlockAttention`` with a sliding window over a ring cache (Gemma's sliding layers): the
reference against an oracle that keeps every position, over a run of verify-like calls that
reject rows and wrap the ring many times; the ONNX function (what ONNX Runtime runs) and the
Triton kernel (interpreted on the CPU) against the reference."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from plugins.block_attention import onnx_function
from plugins.block_attention.reference import block_attention
from plugins.onnx_domain import DOMAIN, PLUGIN_ATTRIBUTES

WINDOW, MOST_ROWS = 4, 5
RING = WINDOW + MOST_ROWS - 1          # the rows a sliding layer's cache needs
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
SCALE = 0.3


def _oracle(q, k_new, v_new, start, history):
    """Each query row over the positions of its window, read from ``history`` (position -> (k, v)
    of the accepted rows) before ``start`` and from the block from there."""
    rows = q.shape[1]
    out = torch.empty_like(q)
    for i in range(rows):
        t = start + i
        seen = range(max(0, t - WINDOW + 1), t + 1)
        keys = torch.stack([history[p][0] if p < start else k_new[:, p - start] for p in seen], dim=1)
        values = torch.stack([history[p][1] if p < start else v_new[:, p - start] for p in seen], dim=1)
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            weights = torch.softmax(q[h, i] @ keys[kv].T * SCALE, dim=-1)
            out[h, i] = weights @ values[kv]
    return out


def _random_block(g, rows):
    return (torch.randn(1, HEADS, rows, HEAD_DIM, generator=g),
            *(torch.randn(1, KV_HEADS, rows, HEAD_DIM, generator=g) for _ in range(2)))


def test_each_row_sees_its_own_window_through_rejections_and_wrap_arounds():
    """Calls of 1 to ``MOST_ROWS`` rows, each keeping only some of them (a verify step's accepted
    rows; the rest stay in the ring as scratch), 40 calls deep into a ring of 8 rows."""
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 1, KV_HEADS, RING, HEAD_DIM, generator=g)
    start, history = 0, {}
    for _ in range(40):
        rows = int(torch.randint(1, MOST_ROWS + 1, (1,), generator=g))
        q, k_new, v_new = _random_block(g, rows)
        out, k_cache, v_cache = block_attention(q, k_new, v_new, k_cache, v_cache, torch.tensor([start]),
                                                causal=True, scale=SCALE, window=WINDOW)
        expected = _oracle(q[0], k_new[0], v_new[0], start, history)
        assert (out[0] - expected).abs().max() < 1e-5
        kept = int(torch.randint(1, rows + 1, (1,), generator=g))
        history |= {start + i: (k_new[0, :, i], v_new[0, :, i]) for i in range(kept)}
        start += kept
    assert start > 4 * RING


def test_without_a_window_rows_are_positions_and_nothing_else_changes():
    """A cache that never wraps (``start + S <= C``) reads as before: a window wider than every
    position gives the unwindowed result, row for row."""
    g = torch.Generator().manual_seed(1)
    q, k_new, v_new = _random_block(g, 5)
    q, k_new, v_new = (t.expand(2, -1, -1, -1) for t in (q, k_new, v_new))
    caches = torch.randn(2, 2, KV_HEADS, 32, HEAD_DIM, generator=g)
    start = torch.tensor([0, 27])
    plain = block_attention(q, k_new, v_new, *caches, start, causal=True, scale=SCALE)
    wide = block_attention(q, k_new, v_new, *caches, start, causal=True, scale=SCALE, window=64)
    narrow = block_attention(q, k_new, v_new, *caches, start, causal=True, scale=SCALE, window=3)
    assert all(torch.equal(a, b) for a, b in zip(plain, wide))
    assert torch.equal(narrow[1], plain[1]) and (narrow[0][1] - plain[0][1]).abs().max() > 1e-3


def _ring_case(g, batch=3, rows=MOST_ROWS):
    """Ragged starts: one before the ring wraps, one at its edge, one many laps in."""
    q = torch.randn(batch, HEADS, rows, HEAD_DIM, generator=g)
    k_new, v_new = (torch.randn(batch, KV_HEADS, rows, HEAD_DIM, generator=g) for _ in range(2))
    k_cache, v_cache = (torch.randn(batch, KV_HEADS, RING, HEAD_DIM, generator=g) for _ in range(2))
    start = torch.tensor([2, RING - 2, 5 * RING + 3])[:batch]
    return q, k_new, v_new, k_cache, v_cache, start


def _single_node_model(window: int, causal: int = 1) -> onnx.ModelProto:
    names = ["q", "k_new", "v_new", "k_cache", "v_cache", "start"]
    node = onnx.helper.make_node(onnx_function.NAME, names, ["out", "k_out", "v_out"], domain=DOMAIN,
                                 causal=causal, scale=SCALE, window=window, **PLUGIN_ATTRIBUTES)
    value, f = onnx.helper.make_tensor_value_info, onnx.TensorProto.FLOAT
    shapes = [["B", HEADS, "S", HEAD_DIM], ["B", KV_HEADS, "S", HEAD_DIM], ["B", KV_HEADS, "S", HEAD_DIM],
              ["B", KV_HEADS, RING, HEAD_DIM], ["B", KV_HEADS, RING, HEAD_DIM]]
    graph = onnx.helper.make_graph(
        [node], "block_attention",
        [value(n, f, s) for n, s in zip(names, shapes)] + [value("start", onnx.TensorProto.INT64, ["B"])],
        [value("out", f, shapes[0]), value("k_out", f, shapes[3]), value("v_out", f, shapes[4])])
    model = onnx.helper.make_model(graph, functions=[onnx_function.BlockAttention.to_function_proto()],
                                   opset_imports=[onnx.helper.make_opsetid("", 23),
                                                  onnx.helper.make_opsetid(DOMAIN, 1)])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("window, rows", [(WINDOW, MOST_ROWS), (WINDOW, 1), (0, 3)])
def test_the_onnx_function_matches_the_reference_on_a_ring(window, rows):
    case = _ring_case(torch.Generator().manual_seed(2), rows=rows)
    if not window:   # no ring without a window: every block within the capacity
        case = (*case[:5], torch.tensor([0, 2, RING - rows]))
    session = ort.InferenceSession(_single_node_model(window).SerializeToString())
    names = ["q", "k_new", "v_new", "k_cache", "v_cache", "start"]
    got = session.run(None, {n: t.numpy() for n, t in zip(names, case)})
    expected = block_attention(*case, causal=True, scale=SCALE, window=window)
    assert np.abs(got[0] - expected[0].numpy()).max() < 1e-5
    assert np.array_equal(got[1], expected[1].numpy()) and np.array_equal(got[2], expected[2].numpy())


@pytest.mark.parametrize("splits", [1, 3])
def test_the_triton_kernel_matches_the_reference_on_a_ring(splits):
    pytest.importorskip("triton")
    from plugins.block_attention import triton_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = _ring_case(torch.Generator().manual_seed(3))
    expected, k_expected, v_expected = block_attention(*case, causal=True, scale=SCALE, window=WINDOW)
    on = [t.to(device) for t in case]
    out = torch.empty_like(on[0])
    triton_kernel.block_attention(*on, out, causal=True, scale=SCALE, window=WINDOW, splits=splits,
                                  block_n=16)
    assert (out.cpu() - expected).abs().max() < 1e-4
    assert torch.equal(on[3].cpu(), k_expected) and torch.equal(on[4].cpu(), v_expected)


def test_a_window_needs_causal_attention():
    case = _ring_case(torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="window 4: a sliding window is defined for causal attention only"):
        block_attention(*case, causal=False, scale=SCALE, window=WINDOW)
