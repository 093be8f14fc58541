"""What gets captured as a CUDA graph and what survives between requests (``runtime/backends/cuda_graphs``),
and how the TensorRT backend's contexts are made for capture (``runtime/backends/trt.py``): the parts
that run without a GPU. Capture and replay themselves are checked in ``test_gpu.py``."""
from types import SimpleNamespace

import pytest
import torch

from modeling.pair import load_pair
from runtime.backends.cuda_graphs import Caches, GraphCache, capture_key
from runtime.backends.pytorch import TorchBackend
from runtime.decoding.batch import generate

from conftest import PROMPTS


def test_only_decode_and_verify_shapes_are_captured():
    k = 3
    assert capture_key("target", {"batch": 2, "rows": 4, "logit_rows": 4}, k) == ("target", 2, 4)  # verify
    assert capture_key("target", {"batch": 2, "rows": 1, "logit_rows": 1}, k) == ("target", 2, 1)  # decode
    assert capture_key("draft", {"batch": 3, "ctx_rows": 4}, k) == ("draft", 3, 4)
    assert capture_key("target", {"batch": 2, "rows": 5, "logit_rows": 1}, k) is None   # prefill chunk
    assert capture_key("target", {"batch": 2, "rows": 3, "logit_rows": 1}, k) is None   # a short prompt's
    assert capture_key("draft", {"batch": 1, "ctx_rows": 5}, k) is None


def test_keys_are_bounded_by_max_batch_times_k_plus_one():
    k, max_batch, chunk = 3, 4, 16
    keys = {capture_key(step, sizes, k)
            for batch in range(1, max_batch + 1) for rows in range(1, chunk + 1)
            for step, sizes in [*(("target", {"batch": batch, "rows": rows, "logit_rows": logit_rows})
                                  for logit_rows in range(1, k + 2)),
                                ("draft", {"batch": batch, "ctx_rows": rows})]} - {None}
    for step in ("target", "draft"):
        assert {key[1:] for key in keys if key[0] == step} == {
            (batch, rows) for batch in range(1, max_batch + 1) for rows in range(1, k + 2)}


def _recording_cache(eager_calls, bind_result):
    def eager(step, sizes, inputs):
        eager_calls.append((step, sizes))
        return [inputs[0] + 1]

    binds = []

    def bind(step, sizes, static_inputs):
        binds.append((step, sizes))
        return bind_result

    return GraphCache(3, eager, bind), binds


def test_prefill_runs_eagerly_without_binding_a_key():
    eager_calls = []
    graphs, binds = _recording_cache(eager_calls, bind_result=None)
    out = graphs("target", {"batch": 1, "rows": 9, "logit_rows": 1}, [torch.zeros(1, 9)])
    assert torch.equal(out[0], torch.ones(1, 9))
    assert binds == [] and graphs.graphs == {} and len(eager_calls) == 1


def test_a_key_that_cannot_be_captured_runs_eagerly_and_says_so_once(capsys):
    eager_calls = []
    graphs, binds = _recording_cache(eager_calls, bind_result=None)
    sizes = {"batch": 2, "rows": 4, "logit_rows": 4}
    for _ in range(3):
        out = graphs("target", sizes, [torch.full((2, 4), 5.0)])
        assert torch.equal(out[0], torch.full((2, 4), 6.0))
    assert binds == [("target", sizes)] and len(eager_calls) == 3
    assert graphs.graphs == {("target", 2, 4): None}
    message = capsys.readouterr().err
    assert message.count("cannot be captured as a CUDA graph; it runs eagerly") == 1


def test_caches_keep_their_addresses_for_the_same_or_a_smaller_batch():
    allocated = []

    def allocate(batch):
        allocated.append(batch)
        return {"target": [torch.zeros(batch, 2, 8, 4)], "draft": [torch.zeros(batch, 1, 8, 4)]}

    caches = Caches(allocate)
    assert caches.start(3) and allocated == [3]
    address = caches.full["target"][0].data_ptr()
    for tensor in (*caches["target"], *caches["draft"]):
        tensor.fill_(7.0)                                  # a request writes its rows
    assert not caches.start(2) and not caches.start(3) and allocated == [3]
    assert [t.shape[0] for t in caches["target"] + caches["draft"]] == [3, 3]
    assert caches["target"][0].data_ptr() == address
    assert not caches["target"][0].any() and not caches["draft"][0].any()   # zeroed in place
    assert caches.start(4) and allocated == [3, 4]       # larger: new caches, graphs must go


@pytest.mark.slow
def test_torch_graph_path_captures_decode_keys_and_keeps_them_across_requests(tiny):
    """The graph-mode backend on the CPU, each key that would be captured recorded and run through
    the same in-place step eagerly: its tokens equal the plain backend's over requests of batch 3,
    1, 2 and 4, and only a larger batch than before drops the keys and reallocates the caches."""
    target, draft = load_pair(*tiny(arch="qwen3"))
    options = dict(capacity=96, max_batch=4, max_prompt_chunk=4)
    reference = TorchBackend(target, draft, **options)
    graphed = TorchBackend(target, draft, **options, cuda_graphs=True)
    k = graphed.limits.k
    captured = []

    def capture(step, sizes, inputs):
        captured.append(capture_key(step, sizes, k))
        return None                                        # run it eagerly: no GPU here

    graphed.graphs._capture = capture
    requests = [PROMPTS, PROMPTS[:1], PROMPTS[1:], [*PROMPTS, [26, 27, 28, 29, 30]]]
    new_keys = []
    for number, prompts in enumerate(requests):
        kept = dict(graphed.graphs.graphs)
        addresses = [t.data_ptr() for t in graphed.caches.full.get("target", [])]
        before = len(captured)
        result = generate(graphed, prompts, max_new_tokens=20).token_ids
        assert result == generate(reference, prompts, max_new_tokens=20).token_ids, number
        if number in (1, 2):   # the same or a smaller batch: nothing reallocated, nothing dropped
            assert [t.data_ptr() for t in graphed.caches.full["target"]] == addresses
            assert kept.items() <= graphed.graphs.graphs.items()
        new_keys.append(captured[before:])
    # prefill chunks (4 rows with 1 logit row, and an 11-token prompt's 3-row rest) are not captured
    assert {key for key in new_keys[0] if key[0] == "target"} == {("target", 3, k + 1)}
    assert {batch for _, batch, _ in graphed.graphs.graphs} == {4}   # a larger batch: all anew
    assert all(rows <= k + 1 for _, _, rows in captured) and len(captured) == len(set(captured))


def _fake_engine(created, profile_selected=True):
    """An engine and contexts that record what ``create_context`` asks of them."""
    context = SimpleNamespace(
        set_optimization_profile_async=lambda index, stream: created.append(("profile", index, stream))
        or profile_selected,
        set_device_memory=lambda pointer, size: created.append(("memory", pointer, size)))

    def create_execution_context(argument):
        created.append(("context", argument))
        return context

    return SimpleNamespace(name="target", create_execution_context=create_execution_context,
                           create_runtime_config=lambda: SimpleNamespace(
                               set_execution_context_allocation_strategy=lambda s: created.append(
                                   ("allocation", s)),
                               dynamic_shapes_kernel_specialization_strategy=None,
                               cuda_graph_strategy=None))


def test_captured_tensorrt_rtx_contexts_compile_their_kernels_eagerly():
    trt = pytest.importorskip("tensorrt_rtx")
    from runtime.backends.trt import create_context

    memory = torch.empty(4096, dtype=torch.uint8)
    for captured, specialization in ((True, trt.DynamicShapesKernelSpecializationStrategy.EAGER),
                                     (False, None)):            # prefill: the lazy default
        created = []
        create_context(trt, _fake_engine(created), 1, 1234, memory, captured)
        (_, config), *calls = [c for c in created if c[0] != "allocation"]
        assert config.dynamic_shapes_kernel_specialization_strategy == specialization
        assert config.cuda_graph_strategy == trt.CudaGraphStrategy.DISABLED
        assert ("allocation", trt.ExecutionContextAllocationStrategy.USER_MANAGED) in created
        assert calls == [("memory", memory.data_ptr(), 4096), ("profile", 1, 1234)]


def test_full_tensorrt_contexts_use_our_memory_and_a_refused_profile_is_an_error():
    rtx = pytest.importorskip("tensorrt_rtx")
    from runtime.backends.trt import create_context, stream_capturable

    trt = SimpleNamespace(ExecutionContextAllocationStrategy=rtx.ExecutionContextAllocationStrategy)
    created = []
    memory = torch.empty(256, dtype=torch.uint8)
    create_context(trt, _fake_engine(created), 0, 99, memory, captured=True)   # no runtime config
    assert created == [("context", rtx.ExecutionContextAllocationStrategy.USER_MANAGED),
                       ("memory", memory.data_ptr(), 256), ("profile", 0, 99)]
    with pytest.raises(RuntimeError, match="target: TensorRT could not select optimization profile 1"):
        create_context(rtx, _fake_engine([], profile_selected=False), 1, 99, memory, captured=True)
    assert stream_capturable(SimpleNamespace(), 99)        # full TensorRT cannot tell
    assert not stream_capturable(SimpleNamespace(is_stream_capturable=lambda stream: stream != 99), 99)


def test_tensorrt_rtx_engines_are_built_for_stream_capture():
    pytest.importorskip("tensorrt_rtx")
    from export.trt_build import _config
    from plugins.tensorrt_module import import_tensorrt

    trt = import_tensorrt("trt-rtx")
    builder = trt.Builder(trt.Logger())
    config = _config(trt, builder, {"decode": {"input_ids": ((1, 1), (2, 4), (4, 4))}}, "sm89", None)
    assert config.get_flag(trt.BuilderFlag.REQUIRE_USER_ALLOCATION)
    assert config.num_optimization_profiles == 1
