"""Checks that need a CUDA GPU (skipped elsewhere): the CUDA-graph runtime path. The same checks,
plus TensorRT engines where TensorRT is importable, run from ``scripts/gpu_check.sh``."""
import pytest
import torch

from runtime.backends.ort import OrtBackend
from runtime.backends.pytorch import TorchBackend
from runtime.decoding.batch import generate
from runtime.decoding.batcher import Batcher
from runtime.decoding.params import Params

from conftest import ENGINE_CASES, LIMITS, PROMPTS

pytestmark = pytest.mark.gpu


# hybrid targets too: their state banks are captured by address like the KV caches, and the MoE
# op runs its Triton kernel (no host sync) on CUDA; and Gemma 4, its sliding layers' rings
CASES = {**ENGINE_CASES, "qwen3_5-multimodal": dict(arch="qwen3_5-multimodal"),
         "qwen3_5_moe-multimodal": dict(arch="qwen3_5_moe-multimodal"),
         "gemma4-multimodal": dict(arch="gemma4-multimodal")}


@pytest.mark.parametrize("case", CASES)
def test_torch_on_cuda_with_graphs_equals_onnx_runtime(engine_dir, case):
    engine = engine_dir(LIMITS, **CASES[case])
    ort = OrtBackend(engine)
    backend = TorchBackend.from_engine(engine, device="cuda", cuda_graphs=True)
    kept = {}
    # the second request replays the graphs the first captured; the third, of a smaller batch,
    # keeps them and captures its own
    for prompts in (PROMPTS, PROMPTS, PROMPTS[:1]):
        expected = generate(ort, prompts, max_new_tokens=32).token_ids
        assert generate(backend, prompts, max_new_tokens=32).token_ids == expected
        graphs = backend.graphs.graphs
        assert all(graphs[key] is graph for key, graph in kept.items())
        kept = dict(graphs)
    assert {step for step, _, _ in kept} == {"target", "draft"}
    assert all(graph is not None and rows <= backend.limits.k + 1 for (_, _, rows), graph in kept.items())
    assert {batch for _, batch, _ in kept} == {1, len(PROMPTS)}
    assert torch.cuda.is_available()


@pytest.mark.parametrize("case", ["qwen3-native", "qwen3_5-multimodal", "gemma4-multimodal"])
def test_requests_joining_a_pool_on_cuda_graphs_get_their_own_output(engine_dir, case):
    """Continuous batching on torch-cuda: every decode step replays the whole pool's graphs (an
    empty or prefilling slot is a frozen row) while requests join, one of them prefilled in two
    chunks eagerly on its own slot; each gets what ONNX Runtime gives it alone."""
    engine = engine_dir(LIMITS, **CASES[case])
    prompts = [*PROMPTS, [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42]]
    ort = OrtBackend(engine)
    expected = [generate(ort, [p], max_new_tokens=24).token_ids[0] for p in prompts]
    backend = TorchBackend.from_engine(engine, device="cuda", cuda_graphs=True)
    batcher = Batcher(backend, eos_token_ids=())
    requests = [batcher.submit(prompts[0], Params(max_new_tokens=24))]
    for _ in range(3):
        batcher.step()
    requests += [batcher.submit(p, Params(max_new_tokens=24, speculative=i != 1))
                 for i, p in enumerate(prompts[1:])]
    batcher.run()
    assert [r.token_ids for r in requests] == expected
    assert {batch for _, batch, _ in backend.graphs.graphs} == {LIMITS.max_batch}
