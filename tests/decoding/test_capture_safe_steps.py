"""A step that a CUDA graph captures may not create tensors from host data: the host-to-device copy
fails while a stream is capturing (pytorch/pytorch#91302 is the same rotary pattern). Checked on the
CPU by refusing every tensor made from Python data during a forward of each step."""
import torch
from torch.overrides import TorchFunctionMode

from export.onnx_export import BuildLimits, draft_spec, target_spec
from export.verify_inputs import example_inputs
from modeling.pair import load_pair

FROM_HOST = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy}


class NoTensorsFromHost(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        assert func not in FROM_HOST, f"torch.{func.__name__} inside a step"
        return func(*args, **(kwargs or {}))


def test_neither_step_makes_tensors_from_host_data(tiny):
    target, draft = load_pair(*tiny())
    limits = BuildLimits(max_batch=2, max_seq_len=64, max_prompt_chunk=8)
    for module, spec in ((target, target_spec(target, limits)), (draft, draft_spec(draft, limits))):
        _, inputs = example_inputs(spec, limits, target.config.vocab_size, draft.config.block_size,
                                    torch.Generator().manual_seed(0))
        with torch.no_grad(), NoTensorsFromHost():
            module(*inputs.values())
