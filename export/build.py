"""``python -m export build``: checkpoints -> a self-contained engine directory.

Phases: load (resolve, hash, build the PyTorch modules), export (trace each step to ONNX), verify
(checker, shape inference, ONNX Runtime vs PyTorch), then the manifest and the tokenizer.
"""
from __future__ import annotations

import gc
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import manifest as manifest_file
from .checkpoint import CheckpointError, hf_location, resolve
from .onnx_check import check_model, compare_with_reference
from .onnx_export import DTYPE_NAMES, GraphSpec, Limits, draft_spec, export_graph, sample_inputs, target_spec
from .pair import load_pair

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOKENIZER_DIR = "tokenizer"


@dataclass
class BuildResult:
    files: dict[str, int]          # file name -> bytes
    seconds: float
    max_difference: dict[str, float | None]   # None: not run (bf16 has no ORT CPU kernels)


def build(target: str, draft: str, out: Path, *, k: int | None = None, limits: Limits,
          confidence_threshold: float = 0.0, dtype: str = "fp32", opset: int = 23,
          backend: str = "onnx", gpus: tuple[str, ...] = (), progress: bool = True) -> BuildResult:
    """Build into ``out``, which must exist and be empty (the CLI handles ``--force``).
    ``backend`` ``trt`` / ``trt-rtx`` also builds TensorRT engines (for ``gpus``).
    ``confidence_threshold`` is recorded as the runtime's default (``runtime.speculative``)."""
    if not 0 <= confidence_threshold <= 1:
        raise ValueError(f"--confidence-threshold {confidence_threshold}: expected 0 (verify every "
                         f"draft) .. 1")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if backend not in ("onnx", "trt", "trt-rtx"):
        raise ValueError(f"--backend {backend}: expected onnx, trt or trt-rtx")
    _check_limits(limits)
    dtype_name = DTYPE_NAMES[DTYPES[dtype]]
    started = time.perf_counter()
    steps = ["load checkpoints", "export target", "export draft", "verify target", "verify draft",
             *([f"build {backend} engines"] if backend != "onnx" else []), "write manifest"]
    bar = tqdm(total=len(steps), disable=not progress, unit="phase", leave=False)

    def phase(name: str) -> None:
        bar.set_description(name)

    phase(steps[0])
    target_dir, draft_dir = resolve(target, "target"), resolve(draft, "draft")
    target_step, draft_step = load_pair(target_dir, draft_dir, k=k, dtype=DTYPES[dtype])
    if limits.max_seq_len > target_step.config.max_position_embeddings:
        raise ValueError(f"--max-seq-len {limits.max_seq_len}: the target supports at most "
                         f"{target_step.config.max_position_embeddings} positions")
    sources = {"target": _source(target, target_dir), "draft": _source(draft, draft_dir)}
    tokenizer = _save_tokenizer(target_dir, out / TOKENIZER_DIR)
    bar.update()

    specs = {"target": target_spec(target_step, limits), "draft": draft_spec(draft_step, limits)}
    modules = {"target": target_step, "draft": draft_step}
    inputs = _example_inputs(target_step, draft_step, specs, limits)
    paths = {}
    for name in ("target", "draft"):
        phase(steps[1 + len(paths)])
        paths[name] = export_graph(modules[name], specs[name], inputs[name].pop("trace"), limits, out,
                                   opset)
        bar.update()

    manifest = {
        "created_by": "dspark-trt",
        "source": sources,
        "target": asdict(target_step.config),
        "draft": {**asdict(draft_step.config), "k": draft_step.k,
                  "confidence_threshold": confidence_threshold,
                  "has_d2t": bool(draft_step.d2t.any()), "target_vocab_size": draft_step.target_vocab_size,
                  "precision": {part: DTYPE_NAMES[t] for part, t in draft_step.precision().items()}},
        "limits": asdict(limits),
        "dtype": dtype_name,
        "opset": opset,
        "graphs": {name: spec.to_json() for name, spec in specs.items()},
        "backends": ["onnx"],
        "tools": _tool_versions(),
        "tokenizer": tokenizer,
    }
    # the reference outputs are computed, then the PyTorch weights are let go, so that ONNX Runtime's
    # view of the weights never sits beside PyTorch's copy (peak memory stays near one copy)
    references = {name: None if dtype == "bf16" else _outputs(modules[name], inputs[name]["verify"])
                  for name in modules}
    del modules, target_step, draft_step
    gc.collect()

    differences = {}
    for name in ("target", "draft"):
        phase(f"verify {name}")
        check_model(paths[name])
        differences[name] = None
        if references[name] is not None:
            outputs = [t.name for t in specs[name].outputs]
            differences[name] = compare_with_reference(paths[name], inputs[name]["verify"],
                                                       dict(zip(outputs, references.pop(name))),
                                                       dtype_name)
        bar.update()

    if backend != "onnx":
        from .trt_build import build_engines

        phase(steps[-2])
        engines = build_engines(out, manifest, backend, list(gpus))
        manifest["backends"].append(backend)
        manifest["tools"][backend] = engines.pop("version")
        manifest[backend] = engines
        bar.update()
    phase(steps[-1])
    manifest_file.write(out, manifest)
    bar.update()
    bar.close()
    files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    return BuildResult(files, time.perf_counter() - started, differences)


def _outputs(module: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """``module``'s outputs on ``inputs``; the caches among them are updated copies of inputs."""
    with torch.no_grad():
        return list(module(*inputs.values()))


def _check_limits(limits: Limits) -> None:
    for flag, value in (("--max-batch", limits.max_batch), ("--max-seq-len", limits.max_seq_len),
                        ("--max-prompt-chunk", limits.max_prompt_chunk)):
        if value < 1:
            raise ValueError(f"{flag} {value}: expected a positive integer")
    if limits.max_prompt_chunk > limits.max_seq_len:
        raise ValueError(f"--max-prompt-chunk {limits.max_prompt_chunk}: larger than --max-seq-len "
                         f"{limits.max_seq_len}")


def _source(given: str, directory: Path) -> dict:
    revision = directory.name if "snapshots" in directory.parts else None
    return {"id": str(given), "path": str(directory.resolve()), "revision": revision,
            "files": manifest_file.file_hashes(directory)}


def _save_tokenizer(target_dir: Path, destination: Path) -> str:
    """Copy the target's tokenizer (and chat template) so the engine directory stands alone."""
    from transformers import AutoTokenizer

    try:
        location, options = hf_location(target_dir)
        tokenizer = AutoTokenizer.from_pretrained(location, **options)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{target_dir}: no usable tokenizer ({err}); the engine directory "
                              f"needs the target's tokenizer files") from None
    tokenizer.save_pretrained(destination)
    return TOKENIZER_DIR


def _example_inputs(target, draft, specs: dict[str, GraphSpec], limits: Limits) -> dict:
    """Deterministic inputs: one set to trace with, another (other sizes) to verify with, so that
    the dynamic axes are really dynamic. Each sequence's ``logit_rows`` are drawn apart (a ragged
    choice, as the loop's prefill makes), and every axis size differs from the others and from 1,
    which torch.export would otherwise take for a constant or for a link between axes."""
    generator = torch.Generator().manual_seed(0)
    vocab, capacity, block = target.config.vocab_size, limits.max_seq_len, draft.config.block_size
    sets: dict[str, dict] = {"target": {}, "draft": {}}
    for purpose, batch, rows, logit_rows in (("trace", 2, 3, 4), ("verify", min(3, limits.max_batch), 5, 2)):
        rows = min(rows, limits.max_prompt_chunk) if purpose == "verify" else rows
        if capacity < rows + block:
            raise ValueError(f"--max-seq-len {capacity}: too small to hold a prompt chunk and a "
                             f"draft block of {block}")
        sets["target"][purpose] = sample_inputs(
            specs["target"], {"batch": batch, "rows": rows, "logit_rows": logit_rows}, generator,
            {"input_ids": vocab, "start": capacity - rows + 1, "logit_rows": rows})
        draft_inputs = sample_inputs(
            specs["draft"], {"batch": batch, "ctx_rows": rows}, generator,
            {"ctx_start": capacity - rows - block + 1, "ctx_count": rows + 1, "anchor": vocab})
        draft_inputs["temperature"] = torch.ones(batch)
        draft_inputs["noise"] = torch.zeros_like(draft_inputs["noise"])  # greedy: tokens compare exactly
        sets["draft"][purpose] = draft_inputs
    return sets


def _tool_versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "onnx": onnx.__version__,
            "onnxscript": onnxscript.__version__, "onnxruntime": onnxruntime.__version__}
