"""Build options beyond the fp32 / opset 23 default (opset 24, fp16, bf16), and where the weights go."""
import gc

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from export.build import build
from runtime.backends.ort import OrtBackend
from runtime.decoding.batch import generate

from conftest import LIMITS, PROMPTS, hf_greedy

pytestmark = pytest.mark.slow   # the real-model tier: builds engines or runs servers


def _build(tiny, tmp_path, **options):
    target_dir, draft_dir = tiny()
    return build(str(target_dir), str(draft_dir), tmp_path, limits=LIMITS, progress=False, **options)


@pytest.fixture(scope="module")
def opset_24(tiny, tmp_path_factory):
    """An opset 24 build (``tiny()``'s pair), and the bytes of tensors that were not reachable
    before it and are after it."""
    tiny()
    before = _live_tensor_bytes()
    out = tmp_path_factory.mktemp("opset24")
    result = _build(tiny, out, opset=24)
    return out, result, _live_tensor_bytes() - before


def test_opset_24(tiny, opset_24):
    out, *_ = opset_24
    for name in ("target", "draft"):
        model = onnx.load(out / f"{name}.onnx")
        assert {o.domain: o.version for o in model.opset_import}[""] == 24
        assert all({o.domain: o.version for o in f.opset_import}[""] == 24 for f in model.functions)
    backend = OrtBackend(out)
    result = generate(backend, PROMPTS, max_new_tokens=30, eos_token_ids=backend.limits.eos_token_ids)
    assert result.token_ids == hf_greedy(tiny()[0], PROMPTS, 30)


def test_fp16_speculative_equals_fp16_target_only(tiny, tmp_path):
    result = _build(tiny, tmp_path, dtype="fp16")
    assert all(0 < d <= 2e-2 for d in result.max_difference.values())
    backend = OrtBackend(tmp_path)
    speculative = generate(backend, PROMPTS, max_new_tokens=30)
    target_only = generate(backend, PROMPTS, max_new_tokens=30, speculative=False)
    assert speculative.token_ids == target_only.token_ids


def test_bf16_builds_but_is_not_run_on_cpu(tiny, tmp_path):
    result = _build(tiny, tmp_path, dtype="bf16")
    assert result.max_difference == {"target": None, "draft": None}
    model = onnx.load(tmp_path / "target.onnx")
    cache = next(i for i in model.graph.input if i.name == "k_cache_0")
    assert cache.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    with pytest.raises(ValueError, match="bfloat16 engines cannot run on the ONNX Runtime CPU"):
        OrtBackend(tmp_path)


def test_weights_live_in_external_data(tiny, engine_dir):
    engine = engine_dir(LIMITS)     # tiny()'s pair
    for name in ("target", "draft"):
        model = onnx.load(engine / f"{name}.onnx", load_external_data=False)
        weights = [t for t in model.graph.initializer if t.dims and onnx.numpy_helper.to_array(
            t, base_dir=str(engine)).size >= 1024]
        assert weights and all(t.data_location == onnx.TensorProto.EXTERNAL for t in weights)
        assert (engine / f"{name}.onnx").stat().st_size < (engine / f"{name}.onnx.data").stat().st_size
    backend = OrtBackend(engine)
    result = generate(backend, PROMPTS, max_new_tokens=30, eos_token_ids=backend.limits.eos_token_ids)
    assert result.token_ids == hf_greedy(tiny()[0], PROMPTS, 30)


def _live_tensor_bytes() -> int:
    """Bytes held by the torch tensors and ONNX IR tensors that are still reachable."""
    gc.collect()
    total = 0
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter):  # not the exporter's fake tensors
            total += obj.untyped_storage().nbytes()
        elif isinstance(obj, ir.Tensor) and isinstance(obj.raw, np.ndarray):
            total += obj.nbytes
    return total


def test_no_weight_outlives_its_graph(opset_24):
    """``build`` exports one model at a time and lets each one's tensors go once its graph is
    written, whatever the exporter keeps (onnxscript's rewrite rules hold the last graph they
    matched): a build never holds the draft's weights beside the target's (measured around the
    opset 24 build, which takes the default's steps)."""
    _, result, held = opset_24
    weights = result.files["target.onnx.data"] + result.files["draft.onnx.data"]
    assert held < 0.05 * weights, f"{held} bytes of tensors outlive a build that wrote {weights}"
