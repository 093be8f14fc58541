"""Weight-only int4 / int8 quantization of the linear layers (``build --weights``), and its cost.

Symmetric, blockwise round-to-nearest along each weight's input axis. int4 is the rounding of ONNX
Runtime's ``MatMulNBitsQuantizer`` (a block's scale is its largest-magnitude value over -8, so it
takes that value's sign; the values are rounded and clipped to [-8, 7]; ``tests/test_quantize.py``
holds the two equal). int8 takes a positive scale, the largest magnitude over 127, and [-127, 127]:
TensorRT's ONNX parser refuses a negative int8 scale ("Scale coefficients must all be positive"; it
lets int4's through), and ONNX Runtime fuses either. A graph gets it as standard ONNX: a blocked
``DequantizeLinear`` (int4 / int8 weight, one scale per block, no zero point) feeding a ``MatMul``,
which ONNX Runtime fuses into ``MatMulNBits`` on the CPU and TensorRT-RTX builds as a weight-only
quantized layer, its weights kept int4 / int8 in the engine (``tests/test_tensorrt_build.py``).
The rewrite is ours rather than the tool's, whose QDQ path refuses 8 bits, skips ``Gemm`` (the
target's ``lm_head``) and writes a weight that several MatMuls share (the draft's Markov head, used
``k`` times) once per use. Function bodies (the ``dspark`` nodes') are not touched.

The PyTorch module is quantized first (``quantize_linears``): its weights become the de-quantized
values, so the reference that verifies the graph computes with exactly the graph's weights. The
rounding is idempotent (a block's extreme value maps to -8 or +-127 and back to itself), so
quantizing those values again in the traced graph gives the same integers and scales.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import torch

from .onnx_check import to_numpy

BITS = {"int4": 4, "int8": 8}
FLOAT = "float"   # the weight format of an unquantized graph, as the manifest records it
# the quality cost is measured on the prompts the demo draft's distillation held out (the last 20
# records of the file), token by token, at most this many tokens per prompt
QUALITY_HELD_OUT, QUALITY_MAX_TOKENS = 20, 256


def check_options(weights: str | None, block: int, quantize_draft: bool) -> None:
    """Refuse bad flags in one line, before any work."""
    if weights is not None and weights not in BITS:
        raise ValueError(f"--weights {weights}: expected one of {', '.join(BITS)} (or leave it out for "
                         f"unquantized weights)")
    # ONNX Runtime fuses DequantizeLinear -> MatMul into MatMulNBits only for these block sizes
    if block < 16 or block & (block - 1):
        raise ValueError(f"--weights-block {block}: expected a power of two, at least 16")
    if quantize_draft and weights is None:
        raise ValueError("--quantize-draft: needs --weights int4 or int8")


def rtn(matrix: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """``matrix [K, N]`` (K a multiple of ``block``) -> ``(q int8 [K, N], scales [K / block, N])``,
    the scales in ``matrix``'s dtype."""
    k, n = matrix.shape
    blocks = matrix.astype(np.float32).reshape(k // block, block, n)
    high, low = blocks.max(axis=1), blocks.min(axis=1)
    if bits == 4:
        scales = np.where(np.abs(high) > np.abs(low), high, low) / -8
    else:
        scales = np.maximum(np.abs(high), np.abs(low)) / 127
    safe = np.where(scales == 0, 1, scales)[:, None]
    q = np.clip(np.round(blocks / safe), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1).astype(np.int8)
    return q.reshape(k, n), scales.astype(matrix.dtype)


def dequantize(q: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """What ``DequantizeLinear(q, scales, axis=0, block_size=block)`` computes."""
    expanded = np.repeat(scales.astype(np.float32), block, axis=0)
    return (q.astype(np.float32) * expanded).astype(scales.dtype)


def quantize_linears(module: torch.nn.Module, bits: int, block: int) -> int:
    """Replace the weight of every ``nn.Linear`` whose input size is a multiple of ``block`` by
    its de-quantized values, as a new tensor (a tied ``lm_head`` leaves the embedding as it was).
    Returns how many were replaced; none is refused, so no engine is labelled quantized that is not."""
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    replaced = 0
    for linear in linears:
        if linear.in_features % block:
            continue
        weight = linear.weight.detach()
        matrix = to_numpy(weight.T)
        values = torch.from_numpy(dequantize(*rtn(matrix, bits, block), block).astype(np.float32))
        linear.weight = torch.nn.Parameter(values.T.to(weight.dtype).contiguous(), requires_grad=False)
        replaced += 1
    if not replaced:
        sizes = sorted({m.in_features for m in linears})
        raise ValueError(f"--weights-block {block}: no linear layer's input size ({sizes}) is a "
                         f"multiple of it; choose a smaller block")
    return replaced


def quantize_graph(path: Path, bits: int, block: int) -> int:
    """Rewrite ``path`` (and its ``.data`` file) with every linear layer of the main graph whose
    input size is a multiple of ``block`` as ``DequantizeLinear -> MatMul``; returns how many.
    A linear layer is a ``MatMul`` with a constant 2-D weight, or a ``Gemm(transB=1)`` (the weight
    stored ``[N, K]``). The weights are read mapped from the old file while the new one is written
    beside it, then the new one takes its place."""
    import ml_dtypes
    import onnx_ir as ir

    model = ir.load(path)
    graph = model.graph
    dequantized: dict[tuple[str, bool], ir.Value] = {}   # one DequantizeLinear per shared weight
    replaced = 0
    for node in list(graph):
        found = _linear_weight(node)
        if found is None:
            continue
        weight, transposed = found
        matrix = weight.const_value.numpy()
        matrix = matrix.T if transposed else matrix
        if matrix.shape[0] % block:
            continue
        key = (weight.name, transposed)
        new_nodes = []
        if key not in dequantized:
            q, scales = rtn(np.ascontiguousarray(matrix), bits, block)
            q = q.astype(ml_dtypes.int4) if bits == 4 else q
            stem = f"{weight.name}{'_t' if transposed else ''}_int{bits}"
            values = [ir.Value(name=f"{stem}_{part}", const_value=ir.Tensor(array, name=f"{stem}_{part}"))
                      for part, array in (("q", q), ("scales", scales))]
            for value in values:
                graph.register_initializer(value)
            dq = ir.node("DequantizeLinear", values, attributes={"axis": 0, "block_size": block},
                         name=f"{stem}_dequantize")
            new_nodes.append(dq)
            dequantized[key] = dq.outputs[0]
        matmul = ir.node("MatMul", [node.inputs[0], dequantized[key]], name=node.name)
        new_nodes.append(matmul)
        result = matmul.outputs[0]
        if len(node.inputs) > 2 and node.inputs[2] is not None:   # a Gemm's bias
            add = ir.node("Add", [result, node.inputs[2]], name=f"{node.name}_bias")
            new_nodes.append(add)
            result = add.outputs[0]
        ir.convenience.replace_nodes_and_values(graph, node, [node], new_nodes, node.outputs, [result])
        if not weight.uses():
            graph.initializers.pop(weight.name)
        replaced += 1
    staging = path.parent / f".{path.name}.quantized"
    staging.mkdir()
    try:
        ir.save(model, staging / path.name, external_data=f"{path.name}.data")
        del model, graph, dequantized
        for name in (path.name, f"{path.name}.data"):
            (staging / name).replace(path.parent / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return replaced


def _linear_weight(node) -> tuple[object, bool] | None:
    """``(weight value, stored transposed)`` when ``node`` is a linear layer with a constant 2-D
    weight, else None."""
    if node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return None
    weight = node.inputs[1]
    if weight is None or not weight.is_initializer() or weight.const_value is None:
        return None
    if len(weight.const_value.shape) != 2:
        return None
    if node.op_type == "MatMul":
        return weight, False
    attributes = {name: attr.value for name, attr in node.attributes.items()}
    if (node.op_type == "Gemm" and attributes.get("transB", 0) == 1 and not attributes.get("transA", 0)
            and attributes.get("alpha", 1.0) == 1.0 and attributes.get("beta", 1.0) == 1.0):
        return weight, True
    return None


def held_out_texts(tokenizer, max_tokens: int) -> list[list[int]] | None:
    """Token ids of the held-out prompts the quality cost is measured on (no chat template), each
    cut to ``max_tokens``; None when the prompt file is not there (an installed package)."""
    from .distill import DEFAULT_PROMPTS
    from .prompts import read_jsonl_prompts

    if not DEFAULT_PROMPTS.is_file():
        return None
    prompts = read_jsonl_prompts(DEFAULT_PROMPTS, "prompts")[-QUALITY_HELD_OUT:]
    ids = [tokenizer.encode(text, add_special_tokens=False)[:max_tokens] for text in prompts]
    return [i for i in ids if len(i) > 1]


def teacher_forced(target, texts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-1 prediction and the negative log-likelihood of the true next token at
    every position of ``texts`` (each one sequence from position 0), concatenated."""
    top1, nll = [], []
    with torch.no_grad():
        for ids in texts:
            tokens = torch.tensor([ids])
            rows = torch.arange(len(ids) - 1)[None]
            logits = target(tokens, torch.zeros(1, dtype=torch.long), rows,
                            *target.empty_cache(1, len(ids)))[0][0].float()
            top1.append(logits.argmax(-1))
            nll.append(-torch.log_softmax(logits, -1).gather(1, tokens[0, 1:, None])[:, 0])
    return torch.cat(top1), torch.cat(nll)


def quality_cost(reference: tuple[torch.Tensor, torch.Tensor],
                 quantized: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Teacher-forced top-1 agreement of the quantized target with the unquantized one, and both
    perplexities, from ``teacher_forced`` of each on the same texts."""
    return {"tokens": int(reference[0].numel()),
            "top1_agreement": float((reference[0] == quantized[0]).float().mean()),
            "perplexity": {"reference": math.exp(float(reference[1].mean())),
                           "quantized": math.exp(float(quantized[1].mean()))}}
