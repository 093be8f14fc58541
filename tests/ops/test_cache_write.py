"""``dspark::CacheWrite``: the custom op, its ONNX function (what ONNX Runtime runs) and the Triton
kernel of its TensorRT plugin (on CPU tensors under TRITON_INTERPRET=1 where there is no GPU), all
against the PyTorch reference."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from plugins.cache_write import cache_write, onnx_function
from plugins.cache_write.reference import cache_write as reference
from plugins.onnx_domain import DOMAIN, PLUGIN_ATTRIBUTES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
START = [0, 9, 43]                    # ragged; the last sequence's block ends at the last cache row


def _example(dtype=torch.float32, head_dim=24):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 2, 48, head_dim, generator=g).to(dtype)
    new = torch.randn(3, 2, 5, head_dim, generator=g).to(dtype)
    return cache, new, torch.tensor(START)


def test_reference_writes_only_the_block_rows():
    cache, new, start = _example()
    out = reference(cache, new, start)
    for b, first in enumerate(START):
        assert torch.equal(out[b, :, first:first + 5], new[b])
        assert torch.equal(out[b, :, :first], cache[b, :, :first])
        assert torch.equal(out[b, :, first + 5:], cache[b, :, first + 5:])


def test_the_op_returns_a_new_cache_and_leaves_its_input_alone():
    """``mutates_args=()``: the graph's cache input is not written (TensorRT's plugin may alias it)."""
    cache, new, start = _example()
    before = cache.clone()
    out = cache_write(cache, new, start)
    assert torch.equal(cache, before) and torch.equal(out, reference(before, new, start))


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 24), (torch.float16, 16), (torch.bfloat16, 128)])
def test_the_plugin_kernel_writes_the_reference_in_place(dtype, head_dim):
    pytest.importorskip("triton")
    from plugins.cache_write.triton_kernel import write_rows

    cache, new, start = _example(dtype, head_dim)
    expected = reference(cache, new, start)
    on_device = cache.to(DEVICE)
    write_rows(new.to(DEVICE), on_device, start.to(DEVICE))
    assert torch.equal(on_device.cpu(), expected)


def test_the_onnx_function_matches_the_reference():
    """One ``dspark::CacheWrite`` node as the exporter writes it, run by ONNX Runtime through its
    model-local function."""
    cache, new, start = _example()
    node = onnx.helper.make_node(onnx_function.NAME, ["cache", "new", "start"], ["cache_out"],
                                 domain=DOMAIN, **PLUGIN_ATTRIBUTES)
    value = onnx.helper.make_tensor_value_info
    graph = onnx.helper.make_graph(
        [node], "cache_write",
        [value("cache", onnx.TensorProto.FLOAT, ["B", 2, 48, 24]),
         value("new", onnx.TensorProto.FLOAT, ["B", 2, "S", 24]),
         value("start", onnx.TensorProto.INT64, ["B"])],
        [value("cache_out", onnx.TensorProto.FLOAT, ["B", 2, 48, 24])])
    function = onnx_function.CacheWrite.to_function_proto()
    model = onnx.helper.make_model(graph, functions=[function], opset_imports=[
        onnx.helper.make_opsetid("", 23), onnx.helper.make_opsetid(DOMAIN, 1)])
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString())
    (out,) = session.run(None, {"cache": cache.numpy(), "new": new.numpy(), "start": start.numpy()})
    assert np.array_equal(out, reference(cache, new, start).numpy())
