"""Checks that need a CUDA GPU (skipped elsewhere): the CUDA-graph runtime path. The same checks,
plus TensorRT engines where TensorRT is importable, run from ``scripts/gpu_check.sh``."""
import pytest
import torch

from export.onnx_export import Limits
from runtime.ort_backend import OrtBackend
from runtime.speculative import generate
from runtime.torch_backend import TorchBackend

from conftest import ENGINE_CASES, PROMPTS

pytestmark = pytest.mark.gpu
LIMITS = Limits(max_batch=4, max_seq_len=96, max_prompt_chunk=8)


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_torch_on_cuda_with_graphs_equals_onnx_runtime(engine_dir, case):
    engine = engine_dir(LIMITS, **ENGINE_CASES[case])
    expected = generate(OrtBackend(engine), PROMPTS, max_new_tokens=32).token_ids
    backend = TorchBackend.from_engine(engine, device="cuda", cuda_graphs=True)
    for _ in range(2):  # the second run replays the graphs the first captured
        assert generate(backend, PROMPTS, max_new_tokens=32).token_ids == expected
    assert backend.graphs["target"].graphs and backend.graphs["draft"].graphs
    assert torch.cuda.is_available()
