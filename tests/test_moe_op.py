"""``dspark::MoeExperts`` against ``transformers``' own experts (``Qwen3MoeExperts``), and its ONNX
function in ONNX Runtime against the reference, fp32 and fp16: a decode step (1 token), a verify
block (9 tokens, most experts selected by some token) and a prefill chunk."""
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from plugins.moe import onnx_function
from plugins.moe.reference import moe_experts
from plugins.onnx_domain import PLUGIN_ATTRIBUTES

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 16, 4, 32, 24


def routed(tokens: int, seed: int = 0):
    """Tokens routed as a Qwen3-MoE router routes them: softmax, top-k, renormalised."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    probs = torch.randn(tokens, EXPERTS, generator=g).softmax(-1)
    weights, experts = probs.topk(TOP_K, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    gate_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) * HIDDEN ** -0.5
    down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=g) * INTERMEDIATE ** -0.5
    return x, experts, weights, gate_up, down


@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_matches_transformers_experts(tokens):
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    x, experts, weights, gate_up, down = routed(tokens)
    config = AutoConfig.for_model("qwen3_moe", hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE,
                                  num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    reference = Qwen3MoeExperts(config)
    with torch.no_grad():
        reference.gate_up_proj.copy_(gate_up)
        reference.down_proj.copy_(down)
        expected = reference(x, experts, weights)
    assert torch.equal(moe_experts(x, experts, weights, gate_up, down), expected)


def _onnx_model(dtype) -> onnx.ModelProto:
    names = onnx_function.INPUTS
    ranks = dict(x=2, experts=2, weights=2, gate_up=3, down=3, out=2)
    types = {n: TensorProto.INT64 if n == "experts" else dtype for n in names}
    node = helper.make_node(onnx_function.NAME, names, onnx_function.OUTPUTS, domain="dspark",
                            **PLUGIN_ATTRIBUTES)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, types[n], [None] * ranks[n]) for n in names],
        [helper.make_tensor_value_info("out", dtype, [None, None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23),
                                                    helper.make_opsetid("dspark", 1)],
                              functions=[onnx_function.MoeExperts.to_function_proto()])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-2)])
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_onnx_function_matches_reference(tokens, dtype, tolerance):
    import onnxruntime as ort

    onnx_type = TensorProto.FLOAT if dtype == torch.float32 else TensorProto.FLOAT16
    session = ort.InferenceSession(_onnx_model(onnx_type).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    inputs = [t if t.dtype == torch.long else t.to(dtype) for t in routed(tokens, seed=1)]
    (out,) = session.run(None, dict(zip(onnx_function.INPUTS, (t.numpy() for t in inputs))))
    expected = moe_experts(*[t if t.dtype == torch.long else t.float() for t in inputs])
    np.testing.assert_allclose(out.astype(np.float32), expected.numpy(), atol=tolerance)
