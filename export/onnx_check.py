"""Build-time verification of an exported graph: the ONNX checker, shape inference, and one run
in ONNX Runtime against the PyTorch module it was traced from."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from common.errors import VerificationError
from common.manifest import is_cache
from plugins.cpu.build import library
from plugins.ort_session import lowered_session

# max |ORT - PyTorch| allowed, relative to max(1, max |reference|), per activation dtype. Rounding
# differences grow with depth: the tiny pairs agree to ~2e-6, the 30-layer SmolLM2 target to 1.4e-4
# in fp32; a semantic error (a wrong mask, position or weight) is orders of magnitude above these.
TOLERANCE = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}


def check_model(path: Path) -> None:
    """``onnx.checker`` (full check, by path so external data is allowed) and strict shape
    inference through the ``dspark`` schemas and function bodies."""
    import onnx

    onnx.checker.check_model(str(path), full_check=True)
    onnx.shape_inference.infer_shapes_path(str(path), str(path) + ".inferred", strict_mode=True)
    Path(str(path) + ".inferred").unlink()


def compare_with_reference(path: Path, inputs: dict[str, torch.Tensor],
                           expected: dict[str, torch.Tensor], dtype: str,
                           drafts: tuple[str, str] | None = None,
                           rotary: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """Run the graph in ONNX Runtime on ``inputs`` and compare with the PyTorch module's outputs
    ``expected`` (by output name). Integer outputs must be identical; float outputs within
    ``TOLERANCE``. Returns the largest relative float difference. ``drafts`` names the draft
    graph's (tokens, probabilities) outputs, compared as ``_comparable_drafts`` says. The graph
    is also run as the ORT backend runs it, one sequence per call with its attention lowered to
    ONNX Runtime's own kernels (``plugins/block_attention/ort_contrib.py``; ``rotary``: the
    decoder's cos / sin tables that form takes), on the first sequence of ``inputs``. An fp16
    graph's products run there on the compiled kernel, as the runtime runs them (``HMatMul``, its
    weights in fp16). Quantized layers stay ONNX Runtime's: the compiled kernel quantizes
    activations to int8, as llama.cpp does, which is a cost in quality the manifest measures, not
    a difference from the graph (``tests/ops/test_cpu_kernels.py`` checks the kernel against what it
    defines).

    The session maps the weights from the file and keeps them as they are (basic graph
    optimizations, no pre-packing), and frees what each op allocates (no arena or memory pattern,
    which would keep the largest transients). A quantized weight is de-quantized just before its
    product in ONNX Runtime's default order, the graph's weight-only nodes being first
    (``qdq._weights_first``). The CPU has no fp16 matrix kernels, so ONNX Runtime casts each fp16
    weight to fp32 before its op; in its default order those casts, which it adds, all run first
    and every weight is held in fp32 at once (3x an fp16 graph's weights). Priority-based order
    runs each cast just before its consumer, so an fp16 graph is run in that order: verifying a
    graph costs its weights plus the largest one in fp32."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), _options(dtype), providers=["CPUExecutionProvider"])
    feeds = {name: to_numpy(tensor) for name, tensor in inputs.items()}
    got = dict(zip(expected, session.run(list(expected), feeds)))
    expected = {name: t.float().numpy() if t.is_floating_point() else t.numpy()
                for name, t in expected.items()}
    worst = _compare(path, got, expected, dtype, drafts)
    del session   # one session's weights at a time
    lowered = lowered_session(path, _options(dtype), rotary, library() if dtype == "float16" else None)
    if lowered is not None:   # the outputs but the caches, whose rows past the new ones are scratch
        names = [name for name in expected if not is_cache(name)]
        first = dict(zip(names, lowered.run(names, {name: value[:1] for name, value in feeds.items()})))
        _compare(path, first, {name: expected[name][:1] for name in names}, dtype, drafts,
                 " of the graph as ONNX Runtime runs it at batch 1 (lowered: plugins/ort_session.py)")
    return worst


def _compare(path: Path, got: dict, expected: dict, dtype: str, drafts: tuple[str, str] | None,
             form: str = "") -> float:
    """``compare_with_reference``'s comparison of ``got`` with ``expected`` (by output name; ``form``
    says which run of the graph gave ``got``, for messages). Returns the largest relative float
    difference."""
    got, expected, tolerance = dict(got), dict(expected), TOLERANCE[dtype]
    if drafts is not None:
        tokens, probabilities = drafts
        rows = _comparable_drafts(path, got[tokens], expected[tokens], expected[probabilities], tolerance,
                                  form)
        for outputs in (got, expected):
            outputs[tokens] = outputs[tokens][:, :rows]
            outputs[probabilities] = outputs[probabilities][:, :rows + 1]
    worst = 0.0
    for name, reference in expected.items():
        actual = got[name]
        if not np.issubdtype(reference.dtype, np.floating):
            if not np.array_equal(actual, reference):
                raise VerificationError(f"{path.name}: output '{name}'{form} differs from the PyTorch "
                                        f"reference at {int((actual != reference).sum())} of "
                                        f"{reference.size} positions")
            continue
        difference = _relative_difference(actual, reference)
        if not difference <= tolerance:
            raise VerificationError(f"{path.name}: output '{name}'{form} differs from the PyTorch "
                                    f"reference by {difference:.3g} (relative; tolerance "
                                    f"{tolerance:g} for {dtype})")
        worst = max(worst, difference)
    return worst


def _relative_difference(actual: np.ndarray, reference: np.ndarray) -> float:
    """max |actual - reference| relative to max(1, max |reference|), as ``TOLERANCE`` bounds it."""
    scale = max(1.0, float(np.abs(reference).max()))
    return float(np.abs(actual.astype(np.float32) - reference).max()) / scale


def _options(dtype: str):
    """ONNX Runtime settings of a verification run of a ``dtype`` graph (``compare_with_reference``
    says why)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    # priority-based order runs the quantized weights' de-quantization first (it reaches nodes
    # with no activations among their inputs early), the default one an fp16 weight's cast
    options.execution_order = (ort.ExecutionOrder.PRIORITY_BASED if dtype == "float16"
                               else ort.ExecutionOrder.DEFAULT)
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.enable_cpu_mem_arena = False
    options.enable_mem_pattern = False
    return options


def _comparable_drafts(path: Path, actual: np.ndarray, reference: np.ndarray,
                       probabilities: np.ndarray, tolerance: float, form: str = "") -> int:
    """How many leading draft rows must match exactly. Each draft is the argmax of its row's
    distribution, and each row is conditioned on the draft before it. Where rounding makes the
    two runtimes pick different tokens at a near tie (the reference gives the two within
    ``tolerance`` of each other, relatively: random-weight models are full of near ties over a
    152k vocabulary), the row's distribution is still compared, and the rows after it, conditioned
    on different tokens, are not. A different token that is no near tie is an error."""
    differ = actual != reference
    if not differ.any():
        return reference.shape[1]
    row = int(differ.any(axis=0).argmax())
    for sequence in np.flatnonzero(differ[:, row]):
        chosen, best = probabilities[sequence, row, [actual[sequence, row], reference[sequence, row]]]
        if not chosen >= (1 - tolerance) * best:
            raise VerificationError(f"{path.name}: draft {row} of sequence {sequence}{form} is token "
                                    f"{actual[sequence, row]}, the PyTorch reference's is "
                                    f"{reference[sequence, row]} (reference probabilities "
                                    f"{chosen:.3g} and {best:.3g}: not a near tie)")
    return row


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as numpy in its own dtype (bf16 through ``ml_dtypes``, which numpy lacks)."""
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.float().numpy().astype(ml_dtypes.bfloat16)
    return tensor.numpy()
