"""``python -m export triton-repo ENGINE OUT``: an engine directory as a model of a Triton Inference
Server model repository, ``OUT/NAME/config.pbtxt`` and ``OUT/NAME/1/model.py``.

The model is a decoupled Python-backend model (``tritonserver_model.py``) with the inputs and
outputs of Triton's generate extension, so ``/v2/models/NAME/generate`` and ``generate_stream``
work with no client of ours. The engine directory is referenced by its absolute path, not copied;
the Python environment that Triton's Python-backend stub runs must have dspark-trt installed.
"""
from __future__ import annotations

import re
from pathlib import Path

from common.outputs import check_replaceable, staged_directory

MODEL_PY = '''"""Triton's Python backend loads this file; the model is dspark-trt's
runtime.serving.tritonserver_model, which the Python environment Triton's stub runs in must have
installed."""
from runtime.serving.tritonserver_model import TritonPythonModel  # noqa: F401
'''


def config(name: str, parameters: dict[str, str], instances: int, gpu: bool) -> str:
    """``config.pbtxt``: decoupled, batching left to the model's own scheduler (``max_batch_size``
    0), every input but ``text_input`` optional."""
    from runtime.serving.tritonserver_io import INPUTS, OUTPUTS

    def tensor(entry, optional):
        tensor_name, kind, dims = entry[:3]
        return (f'  {{ name: "{tensor_name}" data_type: {kind} dims: [ {dims} ]'
                f'{" optional: true" if optional else ""} }}')

    inputs = ",\n".join(tensor(entry, i > 0) for i, entry in enumerate(INPUTS))
    outputs = ",\n".join(tensor(entry, False) for entry in OUTPUTS)
    values = ",\n".join(f'  {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
                        for key, value in parameters.items())
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            f"model_transaction_policy {{ decoupled: true }}\n"
            f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
            f"instance_group [ {{ count: {instances} kind: {'KIND_GPU' if gpu else 'KIND_CPU'} }} ]\n"
            f"parameters [\n{values}\n]\n")


def write_model(engine: Path, out: Path, name: str | None = None, backend: str = "ort", instances: int = 1,
                threads: int | None = None, max_queue: int = 64, draft_schedule: str | None = None,
                force: bool = False) -> Path:
    """Write ``out/name`` (default: the engine directory's name) for ``engine``; every option is
    checked first, and another model in ``out`` is left as it is."""
    from common import manifest
    from runtime.backends import BACKENDS, GPU_BACKENDS
    from runtime.decoding.draft_schedule import LoadSchedule

    engine = Path(engine).resolve()
    k = manifest.read(engine)["draft"]["k"]
    name = name or engine.name
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise ValueError(f"--name {name!r}: expected letters, digits, '_', '.' or '-' (a Triton model name)")
    if backend not in BACKENDS:
        raise ValueError(f"--backend {backend}: expected one of {', '.join(BACKENDS)}")
    if instances < 1:
        raise ValueError(f"--instances {instances}: expected at least 1")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads {threads}: expected at least 1")
    if max_queue < 0:
        raise ValueError(f"--max-queue {max_queue}: expected at least 0")
    parameters = {"engine": str(engine), "backend": backend, "max_queue": str(max_queue)}
    if threads is not None:
        parameters["threads"] = str(threads)
    fixed = LoadSchedule.parse(draft_schedule, k) if draft_schedule is not None else None
    if fixed is not None:
        parameters["draft_schedule"] = str(fixed)
    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"OUT {out}: is a file; expected a model repository directory")
    model = Path(out) / name
    check_replaceable(model, force, "OUT/NAME", sources=(engine,))
    with staged_directory(model, "OUT/NAME") as staging:
        (staging / "config.pbtxt").write_text(config(name, parameters, instances, backend in GPU_BACKENDS))
        (staging / "1").mkdir()
        (staging / "1" / "model.py").write_text(MODEL_PY)
    return model
