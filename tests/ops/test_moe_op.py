"""``dspark::MoeExperts`` against ``transformers``' own experts (``Qwen3MoeExperts``, and with the
tanh GELU ``Gemma4TextExperts``), and its ONNX
function in ONNX Runtime against the reference, fp32 and fp16: a decode step (1 token), a verify
block (9 tokens, most experts selected by some token) and a prefill chunk; and its int4 / int8
forms (``--weights``) against the reference on the de-quantized experts."""
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from plugins.cpu.build import library
from plugins.moe import ACTIVATIONS, MATRICES, onnx_function
from plugins.moe.reference import moe_experts
from plugins.onnx_domain import PLUGIN_ATTRIBUTES

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 16, 4, 32, 24
BLOCK = 8   # the quantized forms' block: divides both input sizes


def routed(tokens: int, seed: int = 0, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE):
    """Tokens routed as a Qwen3-MoE router routes them: softmax, top-k, renormalised."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    probs = torch.randn(tokens, EXPERTS, generator=g).softmax(-1)
    weights, experts = probs.topk(TOP_K, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    gate_up = torch.randn(EXPERTS, 2 * intermediate, hidden, generator=g) * hidden ** -0.5
    down = torch.randn(EXPERTS, hidden, intermediate, generator=g) * intermediate ** -0.5
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


@pytest.mark.parametrize("tokens", [1, 9])
def test_the_gelu_experts_match_gemma4s(tokens):
    from transformers import AutoConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    x, experts, weights, gate_up, down = routed(tokens)
    config = AutoConfig.for_model("gemma4_text", hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE,
                                  num_experts=EXPERTS, top_k_experts=TOP_K, enable_moe_block=True)
    reference = Gemma4TextExperts(config)
    with torch.no_grad():
        reference.gate_up_proj.copy_(gate_up)
        reference.down_proj.copy_(down)
        expected = reference(x, experts, weights)
    assert torch.equal(moe_experts(x, experts, weights, gate_up, down, ACTIVATIONS.index("gelu_tanh")),
                       expected)
    assert not torch.equal(moe_experts(x, experts, weights, gate_up, down), expected)


def _onnx_model(dtype, bits: int | None = None, activation: int = 0) -> onnx.ModelProto:
    """One ``MoeExperts`` node, or with ``bits`` one ``MoeExpertsInt{bits}``."""
    names = onnx_function.QUANTIZED_INPUTS if bits else onnx_function.INPUTS
    integers = TensorProto.INT8
    types = {n: TensorProto.INT64 if n == "experts" else integers if n.endswith("_q") else dtype
             for n in names}
    node = helper.make_node(f"{onnx_function.NAME}Int{bits}" if bits else onnx_function.NAME, names,
                            onnx_function.OUTPUTS, domain="dspark", activation=activation,
                            **PLUGIN_ATTRIBUTES)
    rank = {n: 2 if n in ("x", "experts", "weights") else 4 if n.endswith("_q") else 3 for n in names}
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, types[n], [None] * rank[n]) for n in names],
        [helper.make_tensor_value_info("out", dtype, [None, None])])
    function = (onnx_function.quantized_function(bits) if bits else
                onnx_function.MoeExperts.to_function_proto())
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23),
                                                    helper.make_opsetid("dspark", 1)],
                              functions=[function])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("activation", [0, 1], ids=ACTIVATIONS)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-2)])
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_onnx_function_matches_reference(tokens, dtype, tolerance, activation):
    import onnxruntime as ort

    onnx_type = TensorProto.FLOAT if dtype == torch.float32 else TensorProto.FLOAT16
    session = ort.InferenceSession(_onnx_model(onnx_type, activation=activation).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    inputs = [t if t.dtype == torch.long else t.to(dtype) for t in routed(tokens, seed=1)]
    (out,) = session.run(None, dict(zip(onnx_function.INPUTS, (t.numpy() for t in inputs))))
    expected = moe_experts(*[t if t.dtype == torch.long else t.float() for t in inputs], activation)
    np.testing.assert_allclose(out.astype(np.float32), expected.numpy(), atol=tolerance)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-2)])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [1, 9])
def test_quantized_forms_match_the_reference_on_their_weights(tokens, bits, dtype, tolerance):
    """The integers and blocks ``quantize_graph`` writes, de-quantized expert by expert in the
    graph, compute what the reference computes with the module's de-quantized experts."""
    import onnxruntime as ort

    from export import qdq, quantize

    x, experts, weights, gate_up, down = (t if t.dtype == torch.long else t.to(dtype)
                                          for t in routed(tokens, seed=2))
    stacks = [quantize.dequantized(m, bits, BLOCK).detach() for m in (gate_up, down)]
    feeds = {"x": x, "experts": experts, "weights": weights}
    for name, stack in zip(MATRICES, stacks):
        q, scales, _ = qdq.expert_blocks(stack.numpy(), quantize.rtn_blocks(bits, BLOCK))
        feeds |= {f"{name}_q": torch.from_numpy(q), f"{name}_scales": torch.from_numpy(scales)}
        assert q.dtype == np.int8
        assert q.shape == (EXPERTS, stack.shape[-1] // BLOCK, BLOCK * bits // 8, stack.shape[1])
    onnx_type = TensorProto.FLOAT if dtype == torch.float32 else TensorProto.FLOAT16
    session = ort.InferenceSession(_onnx_model(onnx_type, bits).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {n: t.numpy() for n, t in feeds.items()})
    expected = moe_experts(x.float(), experts, weights.float(), *(s.float() for s in stacks))
    np.testing.assert_allclose(out.astype(np.float32), expected.numpy(), atol=tolerance)
    assert not torch.equal(stacks[0], gate_up)   # the weights were rounded


@pytest.mark.slow
@pytest.mark.parametrize("activation", [0, 1], ids=ACTIVATIONS)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-2)])
@pytest.mark.parametrize("tokens", [1, 9, 70])
def test_triton_kernel_matches_reference(tokens, dtype, tolerance, activation):
    """Blocks that do not divide the widths (24 by 16), an expert with more pairs than a block (at
    70 tokens), experts nobody chose; a token's output the same alone as among others."""
    pytest.importorskip("triton")
    from plugins.moe import triton_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, experts, weights, gate_up, down = (t if t.dtype == torch.long else t.to(dtype)
                                          for t in routed(tokens, seed=3))
    expected = moe_experts(x.float(), experts, weights.float(), gate_up.float(), down.float(), activation)

    def kernel(x, experts, weights):
        on = [t.to(device).contiguous() for t in (x, experts, weights, gate_up, down)]
        out = torch.empty_like(on[0])
        workspace = torch.empty(triton_kernel.workspace_bytes(len(x), TOP_K, EXPERTS, HIDDEN,
                                                              INTERMEDIATE) // 4, device=device)
        triton_kernel.moe_experts(*on, out, workspace, activation=activation, block_n=16, block_k=16)
        return out.cpu()

    out = kernel(x, experts, weights)
    np.testing.assert_allclose(out.float().numpy(), expected.numpy(), atol=tolerance)
    alone = kernel(x[-1:], experts[-1:], weights[-1:])
    if device == "cuda":
        assert torch.equal(alone, out[-1:])
    else:   # the interpreter's dots are numpy's, whose rounding may follow the other rows
        torch.testing.assert_close(alone, out[-1:], atol=1e-6, rtol=0)
    if tokens == 70:
        assert torch.bincount(experts.flatten()).max() > 16


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
def test_triton_kernel_reads_the_quantized_layout(bits):
    """The integers and scales ``quantize_graph`` writes, de-quantized tile by tile (blocks of 8
    under tiles of 16): the reference's output on the de-quantized experts."""
    pytest.importorskip("triton")
    from export import qdq, quantize
    from plugins.moe import triton_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, experts, weights, gate_up, down = routed(9, seed=4)
    stacks = [quantize.dequantized(m, bits, BLOCK).detach() for m in (gate_up, down)]
    expected = moe_experts(x, experts, weights, *stacks)
    (gate_up_q, gate_up_scales, _), (down_q, down_scales, _) = (
        qdq.expert_blocks(stack.numpy(), quantize.rtn_blocks(bits, BLOCK)) for stack in stacks)
    on = [torch.from_numpy(t).to(device) if isinstance(t, np.ndarray) else t.to(device).contiguous()
          for t in (x, experts, weights, gate_up_q, down_q, gate_up_scales, down_scales)]
    out = torch.empty_like(on[0])
    workspace = torch.empty(triton_kernel.workspace_bytes(9, TOP_K, EXPERTS, HIDDEN, INTERMEDIATE) // 4,
                            device=device)
    triton_kernel.moe_experts(*on[:5], out, workspace, *on[5:], bits=bits, block_n=16, block_k=16)
    np.testing.assert_allclose(out.cpu().numpy(), expected.numpy(), atol=1e-5)


@pytest.mark.skipif(library() is None, reason="no compiler or no AVX2: the stock path runs")
@pytest.mark.parametrize("activation", [0, 1], ids=ACTIVATIONS)
@pytest.mark.parametrize("form, op, tolerance", [
    ("int4", "QMoeExperts", 2e-2), ("int8", "QMoeExperts", 2e-2), ("float32", "FMoeExperts", 1e-5),
    ("float16", "HMoeExperts", 2e-2)])
def test_the_compiled_kernels_run_the_experts_a_token_as_alone(tmp_path, form, op, tolerance, activation):
    """Loaded with the compiled kernels, a ``MoeExperts`` node with constant experts (int4 / int8
    in blocks of 32, float32 or fp16) becomes one ``dspark.cpu`` op: it computes the reference's
    experts (within int8 activations' error where the weights are integers), and a token's output
    is the same bits alone as among 9 tokens."""
    import onnx_ir as ir
    import onnxruntime as ort
    from onnx import numpy_helper

    from export import qdq, quantize
    from plugins.moe import ort_cpu
    from plugins.ort_session import lowered_session

    dtype = torch.float16 if form == "float16" else torch.float32
    x, experts, weights, gate_up, down = (t if t.dtype == torch.long else t.to(dtype)
                                          for t in routed(9, seed=3, hidden=64, intermediate=32))
    bits = {"int4": 4, "int8": 8}.get(form)
    stacks = [quantize.dequantized(m, bits, 32).detach() if bits else m for m in (gate_up, down)]
    model = _onnx_model(TensorProto.FLOAT16 if form == "float16" else TensorProto.FLOAT, bits, activation)
    for name, stack in zip(MATRICES, stacks):
        arrays = {name: stack.numpy()}
        if bits:
            q, scales, _ = qdq.expert_blocks(stack.numpy(), quantize.rtn_blocks(bits, 32))
            arrays = {f"{name}_q": q, f"{name}_scales": scales}
        model.graph.initializer.extend(numpy_helper.from_array(a, n) for n, a in arrays.items())
    kept = [i for i in model.graph.input if i.name in ("x", "experts", "weights")]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    path = tmp_path / "moe.onnx"
    onnx.save(model, path)
    session = lowered_session(path, ort.SessionOptions(), kernel=library())
    lowered = ir.load(path)
    assert len(ort_cpu.lower(lowered, path.name)) == (6 if bits else 2)
    assert [(n.domain, n.op_type) for n in lowered.graph] == [("dspark.cpu", op)]

    def run(rows):
        feeds = {"x": x[rows].numpy(), "experts": experts[rows].numpy(), "weights": weights[rows].numpy()}
        return session.run(None, feeds)[0]

    out = run(slice(None))
    expected = moe_experts(x.float(), experts, weights.float(), *(s.float() for s in stacks),
                           activation).numpy()
    assert np.abs(out.astype(np.float32) - expected).max() < tolerance * np.abs(expected).max()
    if bits:   # the function de-quantizes in float32; the kernel quantizes x to int8, as llama.cpp does
        stock = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
            None, {"x": x.numpy(), "experts": experts.numpy(), "weights": weights.numpy()})[0]
        assert 0 < np.abs(out - stock).max() < tolerance * np.abs(expected).max()
    assert np.array_equal(np.concatenate([run(slice(t, t + 1)) for t in range(9)]), out)
    assert np.array_equal(run(slice(2, 7)), out[2:7])
