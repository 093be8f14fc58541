"""``dspark::GatedDeltaRule`` against ``transformers``' own gated delta rule (recurrent and chunked),
and its ONNX function (in ONNX Runtime) and Triton kernel (interpreter on CPU) against the
reference: for one row, a verify block of k + 1 rows and a prefill chunk, with the slots a
speculative step reads and writes."""
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from plugins.gated_delta import onnx_function
from plugins.gated_delta.reference import gated_delta_rule
from plugins.onnx_domain import PLUGIN_ATTRIBUTES

KEY_HEADS, HEADS, KEY_DIM, VALUE_DIM, SLOTS = 2, 4, 16, 12, 5


def inputs(batch: int, rows: int, seed: int = 0):
    """Random rows as a Qwen3.5 layer makes them: q, k l2-normalised (q scaled), g < 0, beta in
    (0, 1), and a random state bank."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(batch, rows, KEY_HEADS, KEY_DIM, generator=g),
                                          dim=-1) for _ in range(2))
    q = q * KEY_DIM ** -0.5
    v = torch.randn(batch, rows, HEADS, VALUE_DIM, generator=g)
    decay = -torch.rand(batch, rows, HEADS, generator=g) * 2
    beta = torch.rand(batch, rows, HEADS, generator=g)
    state = torch.randn(batch, SLOTS, HEADS, KEY_DIM, VALUE_DIM, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("rows", [1, 5, 70])
def test_matches_transformers(rows):
    """The output rows and the state after the last row equal ``transformers``' recurrent form
    (what its decode steps run), and its chunked form (what its prefill runs, chunks of 64) to
    rounding; the other slots are kept."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, decay, beta, state = inputs(2, rows)
    slot = torch.tensor([3, 0])
    out, bank = gated_delta_rule(q, k, v, decay, beta, state, slot, torch.tensor([[rows - 1]] * 2))
    start = state[torch.arange(2), slot]
    # transformers takes q, k before its own l2 normalisation and scaling: undo the scale only
    # (normalising twice is the identity, to rounding)
    hf_q = q * KEY_DIM ** 0.5
    expected, final = torch_recurrent_gated_delta_rule(hf_q, k, v, decay, beta, initial_state=start,
                                                       output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True)
    assert torch.allclose(out, expected, atol=1e-5) and torch.allclose(bank[:, 0], final, atol=1e-5)
    chunked, chunked_final = torch_chunk_gated_delta_rule(hf_q, k, v, decay, beta, initial_state=start,
                                                          output_final_state=True,
                                                          use_qk_l2norm_in_kernel=True)
    assert torch.allclose(out, chunked, atol=1e-4) and torch.allclose(bank[:, 0], chunked_final, atol=1e-4)
    assert torch.equal(bank[:, 1:], state[:, 1:])


def test_slots_hold_the_state_after_their_rows():
    """Slot j holds the state after row ``state_rows[j]`` (-1: the starting one): the state a run
    of only rows ``0 .. r`` ends with; and a step started from that slot continues the sequence as
    if it had never been cut."""
    q, k, v, decay, beta, state = inputs(1, 6)
    slot = torch.tensor([2])
    picked = torch.tensor([[4, -1, 0, 2]])
    out, bank = gated_delta_rule(q, k, v, decay, beta, state, slot, picked)
    for j, row in enumerate(picked[0].tolist()):
        if row == -1:
            expected = state[0, 2]
        else:
            cut = slice(0, row + 1)
            expected = gated_delta_rule(q[:, cut], k[:, cut], v[:, cut], decay[:, cut], beta[:, cut],
                                        state, slot, torch.tensor([[row]]))[1][0, 0]
        assert torch.allclose(bank[0, j], expected, atol=1e-6)
    # resume after row 2 (slot 3) with rows 3 .. 5: the outputs of the uncut run
    rest = slice(3, 6)
    resumed, _ = gated_delta_rule(q[:, rest], k[:, rest], v[:, rest], decay[:, rest], beta[:, rest],
                                  bank, torch.tensor([3]), torch.tensor([[0]]))
    assert torch.allclose(resumed, out[:, rest], atol=1e-6)
    assert torch.equal(bank[:, 4:], state[:, 4:])


def _onnx_model() -> onnx.ModelProto:
    names = onnx_function.INPUTS
    types = {n: TensorProto.INT64 if n in ("slot", "state_rows") else TensorProto.FLOAT for n in names}
    node = helper.make_node(onnx_function.NAME, names, onnx_function.OUTPUTS, domain="dspark",
                            **PLUGIN_ATTRIBUTES)
    ranks = dict(q=4, k=4, v=4, g=3, beta=3, state=5, slot=1, state_rows=2, out=4, state_out=5)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, types[n], [None] * ranks[n]) for n in names],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None] * ranks[n])
         for n in onnx_function.OUTPUTS])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23),
                                                    helper.make_opsetid("dspark", 1)],
                              functions=[onnx_function.GatedDeltaRule.to_function_proto()])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("rows, picked", [(1, [[0], [-1]]), (5, [[0, 1, 2, 3, 4], [0, 1, 2, -1, -1]]),
                                          (70, [[69], [-1]])])
def test_onnx_function_matches_reference(rows, picked):
    """ONNX Runtime runs the function body: one row, a verify block (every row's state; a shorter
    sequence's rows past its end), a prefill chunk (the last row's state; a prompt that ended
    before the chunk keeps its state)."""
    import onnxruntime as ort

    q, k, v, decay, beta, state = inputs(2, rows, seed=1)
    slot, picked = torch.tensor([1, 4]), torch.tensor(picked)
    session = ort.InferenceSession(_onnx_model().SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = dict(zip(onnx_function.INPUTS, (t.numpy() for t in (q, k, v, decay, beta, state, slot, picked))))
    out, bank = session.run(None, feeds)
    expected, expected_bank = gated_delta_rule(q, k, v, decay, beta, state, slot, picked)
    np.testing.assert_allclose(out, expected.numpy(), atol=1e-5)
    np.testing.assert_allclose(bank, expected_bank.numpy(), atol=1e-5)


@pytest.mark.parametrize("rows, picked", [(1, [[0], [-1]]), (5, [[4, 0, 1, 2, 3], [-1, 0, 1, 2, 3]]),
                                          (70, [[69], [10]])])
@pytest.mark.slow
def test_triton_kernel_matches_reference(rows, picked):
    """In place: the bank's captured slots, the kept ones, and the starting slot read before a
    slot is written (sequence 0 starts from slot 0, which it overwrites)."""
    pytest.importorskip("triton")
    from plugins.gated_delta.triton_kernel import gated_delta_rule as kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, decay, beta, state = inputs(2, rows, seed=2)
    slot, picked = torch.tensor([0, 3]), torch.tensor(picked)
    expected, expected_bank = gated_delta_rule(q, k, v, decay, beta, state, slot, picked)
    on = [t.to(device).contiguous() for t in (q, k, v, decay, beta, state, slot, picked)]
    out = torch.empty_like(on[2])
    kernel(*on, out, block_v=8)
    assert torch.allclose(out.cpu(), expected, atol=1e-5)
    assert torch.allclose(on[5].cpu(), expected_bank, atol=1e-5)
