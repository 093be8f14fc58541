"""What ``python -m export build`` checks before it loads anything: every flag, the paths, the
output directory, and what the draft's ``config.json`` alone says about ``--k``.

It imports no torch, transformers or onnx (``tests/graphs/test_build_cli.py`` holds it to that), so a
mistake is named in a fraction of a second; reading the demo target's GGUF config alone takes 6 s,
its weights 10 s more. ``build()`` runs the same flag checks for callers of the Python API.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from modeling.layouts import check_k, trained_block
from plugins.tensorrt_module import MODULES as TENSORRT_MODULES

BITS = {"int4": 4, "int8": 8}
FLOAT = "float"   # the weight format of an unquantized graph, as the manifest records it
GGUF = "gguf"     # the target GGUF file's own blocks (export/gguf_blocks.py)
# a draft has no GGUF file: beside a GGUF target, --quantize-draft rounds it to int4, the class of
# the file's Q4 blocks (its cost in acceptance and time: docs/measurements.md)
GGUF_DRAFT = "int4"
BACKENDS = ("onnx", "trt", "trt-rtx")
DTYPES = ("fp32", "fp16", "bf16")
GPUS = ("sm75", "sm80", "sm86", "sm89", "sm120", "sm121")   # what TensorRT-RTX builds ahead of time for
DEFAULT_GPU = "sm89"
DEFAULT_MAX_SEQ_LEN = 2048   # or the target's max_position_embeddings, if smaller
DEFAULT_MAX_PROMPT_CHUNK = 512   # or max_seq_len, if smaller


def check_options(*, k: int | None = None, markov_top_k: int = 0, confidence_threshold: float = 0.0,
                  dtype: str = "fp32",
                  backend: str = "onnx", gpus: tuple[str, ...] = (), weights: str | None = None,
                  weights_block: int = 32, quantize_draft: bool = False, max_batch: int = 1,
                  max_seq_len: int | None = None, max_prompt_chunk: int | None = None) -> None:
    """Refuse the first bad flag in one line; ``None`` limits are the defaults, resolved once the
    target's config is read (``max_prompt_chunk`` is then checked against the largest they can be)."""
    if k is not None and k < 1:
        raise ValueError(f"--k {k}: expected at least 1 draft per step")
    if markov_top_k < 0:
        raise ValueError(f"--markov-top-k {markov_top_k}: expected 0 (every draft id) or a positive count")
    if not (math.isfinite(confidence_threshold) and 0 <= confidence_threshold <= 1):
        raise ValueError(f"--confidence-threshold {confidence_threshold}: expected 0 (verify every "
                         f"draft) .. 1")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if backend not in BACKENDS:
        raise ValueError(f"--backend {backend}: expected one of {', '.join(BACKENDS)}")
    check_gpus(backend, gpus)
    for flag, value in (("--max-batch", max_batch), ("--max-seq-len", max_seq_len),
                        ("--max-prompt-chunk", max_prompt_chunk)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: expected a positive integer")
    capacity = DEFAULT_MAX_SEQ_LEN if max_seq_len is None else max_seq_len
    if max_prompt_chunk is not None and max_prompt_chunk > capacity:
        given = "" if max_seq_len is not None else " (its default, at most)"
        raise ValueError(f"--max-prompt-chunk {max_prompt_chunk}: larger than --max-seq-len "
                         f"{capacity}{given}")
    check_weights(weights, weights_block, quantize_draft)
    if weights == GGUF and dtype != "fp32":
        raise ValueError(f"--weights gguf: needs --dtype fp32, got {dtype} (the file's blocks are found by "
                         f"their exact values, which {dtype} rounds); pass --weights float, int4 or "
                         f"int8 to build with --dtype {dtype}")


def check_weights(weights: str | None, block: int, quantize_draft: bool) -> None:
    """``--weights``, ``--weights-block`` and ``--quantize-draft`` together."""
    if weights is not None and weights not in (FLOAT, *BITS, GGUF):
        raise ValueError(f"--weights {weights}: expected one of {FLOAT}, {', '.join(BITS)}, {GGUF}")
    # ONNX Runtime fuses DequantizeLinear -> MatMul into MatMulNBits only for these block sizes
    if block < 16 or block & (block - 1):
        raise ValueError(f"--weights-block {block}: expected a power of two, at least 16")
    if quantize_draft and weights not in (*BITS, GGUF):
        raise ValueError(f"--quantize-draft: needs --weights {', '.join(BITS)} or {GGUF}")
    if weights == GGUF and block != 32:
        raise ValueError(f"--weights-block {block}: --weights gguf keeps the file's blocks of 32")


def gguf_defaults(weights: str | None, quantize_draft: bool | None, dtype: str) -> tuple[str, bool]:
    """A GGUF target's ``--weights`` and ``--quantize-draft`` where not given: the file's own blocks
    (the weights llama.cpp computes with; float32 made a 16 GB engine of a 2.4 GB 4B file), and the
    draft quantized as the target is (int4 beside them), unless ``--weights float``."""
    if weights is None and dtype != "fp32":
        raise ValueError(f"--dtype {dtype}: a GGUF target keeps the file's own blocks (--weights gguf, "
                         f"its default), which need --dtype fp32; pass --weights float, int4 or int8 "
                         f"with --dtype {dtype}")
    weights = weights or GGUF
    return weights, weights != FLOAT if quantize_draft is None else quantize_draft


def check_gpus(backend: str, gpus) -> list[str]:
    """The compute capabilities a ``backend`` build is for (TensorRT-RTX: ``--gpu``, by default
    ``DEFAULT_GPU``; TensorRT: none, it builds for the GPU it runs on)."""
    if gpus and backend != "trt-rtx":
        why = ("TensorRT builds for the GPU it runs on" if backend == "trt"
               else f"--backend {backend} builds no TensorRT engines")
        raise ValueError(f"--gpu {gpus[0]}: applies to --backend trt-rtx; {why}")
    targets = [g.lower() for g in gpus] or ([DEFAULT_GPU] if backend == "trt-rtx" else [])
    for gpu in targets:
        if gpu not in GPUS:
            raise ValueError(f"--gpu {gpu}: expected one of {', '.join(GPUS)}")
    return targets


def check_tensorrt_installed(backend: str) -> None:
    """The TensorRT package a ``backend`` build needs, looked up without importing it."""
    module = TENSORRT_MODULES.get(backend)
    if module and importlib.util.find_spec(module) is None:
        raise ValueError(f"--backend {backend} needs the {module} package: pip install -e "
                         f"'.[{'trt-rtx' if backend == 'trt-rtx' else 'trt'}]'")


def check_draft_k(draft_dir: Path, k: int | None) -> None:
    """``--k`` against the drafts a block of the draft's declared width proposes, from its
    config.json's fields alone; a config this cannot read is left to the loader, which names
    what is wrong with it."""
    from modeling.checkpoint import read_config

    if k is None:
        return
    block = trained_block(read_config(draft_dir))
    if block is not None:
        check_k(k, *block)
