"""Trace ``TargetStep`` and ``DraftStep`` to ONNX with ``torch.onnx.export(dynamo=True)``.

The custom ops become single ``dspark::BlockAttention`` / ``CacheWrite`` / ``D2TGather`` nodes, and each
carries a model-local function of the same domain and name with a standard-op body: ONNX Runtime
runs the body, TensorRT the registered plugin. KV caches have a static capacity (TensorRT needs it
for in-place writes); batch and row counts are dynamic up to the build limits.
"""
from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.manifest import call_rows, is_cache
from modeling.dense import TargetStep
from modeling.draft import DraftStep
from modeling.lazy_weights import LazyWeights
from plugins.block_attention import onnx_function as block_attention_onnx
from plugins.cache_write import onnx_function as cache_write_onnx
from plugins.d2t_gather import onnx_function as d2t_gather_onnx
from plugins.gated_delta import onnx_function as gated_delta_onnx
from plugins.moe import onnx_function as moe_onnx

OPSETS = (23, 24)
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.int64: "int64"}


@dataclass(frozen=True)
class BuildLimits:
    """What an engine is built for (``build --max-batch``, ``--max-seq-len``, ``--max-prompt-chunk``);
    a backend reads them back from the manifest, with the engine's other facts, as
    ``runtime.backends.base.BackendLimits``."""
    max_batch: int
    max_seq_len: int        # KV-cache capacity per sequence (rows == positions)
    max_prompt_chunk: int   # most rows one target call (or draft context update) takes


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple            # ints are static, strings name dynamic axes


@dataclass(frozen=True)
class GraphSpec:
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def to_json(self) -> dict:
        return asdict(self)


def _caches(step, limits: BuildLimits, slots: int = 1) -> tuple[tuple[TensorSpec, ...], ...]:
    """A step module's caches (``CachedStep.cache_specs``) as graph inputs and, named ``_out``,
    outputs: the verify block's ``slots`` rows, and rings sized by the most rows one call writes."""
    rows = call_rows(limits.max_prompt_chunk, slots - 1)
    specs = step.cache_specs("batch", limits.max_seq_len, slots, rows)
    return tuple(tuple(TensorSpec(spec.name(suffix), DTYPE_NAMES[spec.dtype], spec.shape) for spec in specs)
                 for suffix in ("", "_out"))


def target_spec(target: TargetStep, limits: BuildLimits, slots: int = 1) -> GraphSpec:
    """``slots``: the verify block's rows, ``k + 1``. A target whose step ``takes_states`` (a
    hybrid's) also takes ``state_slot`` and ``state_rows``; each family's caches are its step's
    (``CachedStep.cache_specs``)."""
    c, d = target.config, target.config.decoder
    dtype = DTYPE_NAMES[target.lm_head.weight.dtype]
    states = (TensorSpec("state_slot", "int64", ("batch",)),
              TensorSpec("state_rows", "int64", ("batch", "state_rows"))) if target.takes_states else ()
    caches, outputs = _caches(target, limits, slots)
    return GraphSpec("target.onnx", inputs=(
        TensorSpec("input_ids", "int64", ("batch", "rows")),
        TensorSpec("start", "int64", ("batch",)),
        TensorSpec("logit_rows", "int64", ("batch", "logit_rows")),
        *states,
        *caches,
    ), outputs=(
        TensorSpec("logits", dtype, ("batch", "logit_rows", c.vocab_size)),
        TensorSpec("aux", dtype, ("batch", "rows", len(target.taps) * d.hidden_size)),
        *outputs,
    ))


def draft_spec(draft: DraftStep, limits: BuildLimits) -> GraphSpec:
    dtype = DTYPE_NAMES[draft.lm_head.weight.dtype]
    caches, outputs = _caches(draft, limits)
    return GraphSpec("draft.onnx", inputs=(
        TensorSpec("ctx_aux", dtype, ("batch", "ctx_rows", draft.fc.in_features)),
        TensorSpec("ctx_start", "int64", ("batch",)),
        TensorSpec("ctx_count", "int64", ("batch",)),
        TensorSpec("anchor", "int64", ("batch",)),
        TensorSpec("temperature", "float32", ("batch",)),
        TensorSpec("noise", "float32", ("batch", draft.k, draft.target_vocab_size)),
        *caches,
    ), outputs=(
        TensorSpec("tokens", "int64", ("batch", draft.k)),
        TensorSpec("q", "float32", ("batch", draft.k, draft.target_vocab_size)),
        *outputs,
    ))


def sample_inputs(spec: GraphSpec, sizes: dict[str, int], generator: torch.Generator,
                  high: dict[str, int]) -> dict[str, torch.Tensor]:
    """Deterministic inputs of ``spec`` with the dynamic axes set to ``sizes``; integer inputs
    are drawn below ``high[name]``, caches are zero (random keys would make attention of a deep
    model numerically unlike any real run), other floats come from a normal distribution."""
    out = {}
    for t in spec.inputs:
        shape = [sizes[s] if isinstance(s, str) else s for s in t.shape]
        if is_cache(t.name):
            out[t.name] = untouched_zeros(shape, getattr(torch, t.dtype))
        elif t.dtype == "int64":
            out[t.name] = torch.randint(0, high[t.name], shape, generator=generator)
        else:
            out[t.name] = torch.randn(shape, generator=generator).to(getattr(torch, t.dtype))
    return out


def untouched_zeros(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Zeros from ``calloc``: the system maps their pages only when they are written, so caches
    that are only read (by tracing, by a step that writes its new rows to a copy) cost no memory.
    A release-shaped target's zero caches are hundreds of MB, ``torch.zeros`` writes every byte."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).reshape(shape)


def export_graph(module: torch.nn.Module, spec: GraphSpec, example: dict[str, torch.Tensor],
                 limits: BuildLimits, directory: Path, opset: int,
                 weights: LazyWeights | None = None,
                 rewrite: Callable[[Any, Path], object] | None = None) -> Path:
    """Trace ``module`` on ``example`` and write ``directory / spec.file``, its weights in
    ``spec.file + ".data"``: streamed there one tensor at a time (an in-memory protobuf would hold
    about three copies of them), and what ONNX Runtime and TensorRT map or read without a copy.
    A module that holds ``lazy_weights`` placeholders is traced on them and its ``weights`` read
    from the file as each initializer is written (before the optimizer, which folds constants).
    ``rewrite(model, path)`` edits the traced graph (``onnx_ir``) before it is written: a lazy
    module's weights into their blocks (``qdq.quantize_model``), which then never reach the disk as
    floats (an 8B GGUF target's were 32.8 GB of float32, written to be read back once)."""
    if opset not in OPSETS:
        raise ValueError(f"--opset {opset}: expected one of {OPSETS}")
    bounds = {"batch": limits.max_batch, "rows": limits.max_prompt_chunk,
              "ctx_rows": limits.max_prompt_chunk, "logit_rows": limits.max_prompt_chunk,
              "state_rows": limits.max_prompt_chunk}
    # torch.export needs max > min and the tracing sizes inside; the runtime enforces the limits
    dims = {name: torch.export.Dim(name, min=1, max=max(top, 8)) for name, top in bounds.items()}
    dynamic = [{axis: dims[s] for axis, s in enumerate(t.shape) if isinstance(s, str)}
               for t in spec.inputs]
    caches = sum(map(is_cache, (t.name for t in spec.inputs)))
    # forward(named inputs..., *caches): torch.export sees the caches as one trailing tuple
    dynamic = (*dynamic[:-caches], tuple(dynamic[-caches:]))
    translations = {torch.ops.dspark.block_attention.default: block_attention_onnx.translate,
                    torch.ops.dspark.cache_write.default: cache_write_onnx.translate,
                    torch.ops.dspark.d2t_gather.default: d2t_gather_onnx.translate,
                    torch.ops.dspark.gated_delta_rule.default: gated_delta_onnx.translate,
                    torch.ops.dspark.moe_experts.default: moe_onnx.translate}
    # the exporter's chatter: missing torchvision ops, unused axis names, ...
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, args=tuple(example.values()), dynamo=True, opset_version=opset,
            input_names=[t.name for t in spec.inputs], output_names=[t.name for t in spec.outputs],
            dynamic_shapes=dynamic,
            custom_translation_table=translations, verbose=False, optimize=weights is None)
        if weights is not None:
            _read_when_written(program, module, weights)
            _optimize(program.model)
    _attach_functions(program, opset)
    _cast_normalized_inputs(program)
    path = directory / spec.file
    if rewrite is not None:
        rewrite(program.model, path)
    program.save(path, external_data=True)
    # onnxscript's rewrite rules keep the last graph they matched (module-level pattern matchers),
    # which would keep the tensors the optimizer made (folded transposes and casts of weights) alive
    # after this graph is written: drop the graph's references to them
    for initializer in program.model.graph.initializers.values():
        initializer.const_value = None
    return path


def _read_when_written(program, module: torch.nn.Module, weights: LazyWeights) -> None:
    """Give each of ``program``'s initializers that is one of ``module``'s weights (placeholders,
    all of them: see ``lazy_weights``) its values from the file, read each time its bytes are
    asked for (``onnx_ir.LazyTensor``, not kept). A tied weight is read under its first name."""
    import onnx_ir as ir

    first = {id(p): name for name, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
    parameters = dict(module.named_parameters(remove_duplicate=False))
    read = set()
    for name, value in program.model.graph.initializers.items():
        if name not in parameters:
            continue
        source, dtype = first[id(parameters[name])], parameters[name].dtype

        def tensor(source=source, dtype=dtype, name=name):
            return ir.Tensor(weights.load(source).to(dtype).numpy(), name=name)

        value.const_value = ir.LazyTensor(tensor, dtype=value.const_value.dtype,
                                          shape=value.const_value.shape, name=name)
        read.add(id(parameters[name]))
    if len(read) != len(first):   # a weight traced under another name would keep its placeholder
        raise RuntimeError(f"the traced graph names {len(read)} of the module's {len(first)} weights")


def _optimize(model) -> None:
    """What ``ONNXProgram.optimize`` does, but a weight read from the file stays as the file
    holds it: the optimizer folds every ``Transpose`` of a weight into a transposed copy, which
    it keeps until the graph is written (the whole model, de-quantized), where ``MatMul(x,
    Transpose(W))`` is a linear layer as well to the rewrites after it (``linear_weight``)."""
    import onnx_ir as ir
    import onnxscript

    read = {value for value in model.graph.initializers.values()
            if isinstance(value.const_value, ir.LazyTensor)}

    def should_fold(node) -> bool | None:   # None: the optimizer's own rules
        return False if node.op_type == "Transpose" and node.inputs[0] in read else None

    onnxscript.optimizer.optimize_ir(model, should_fold=should_fold)
    onnxscript.rewriter.onnx_fusions.fuse(model)


def _cast_normalized_inputs(program) -> None:
    """Give back the input cast that onnxscript's RMSNorm fusion drops when a norm computes in
    fp32 on a narrower input (Qwen3.5's ``x.float() ... * (1 + w.float())``): it writes
    ``RMSNormalization(x_fp16, scale_fp32)`` with an fp16 output, which the ONNX checker refuses,
    where the op computes in the scale's type. The cast restores what the module computes."""
    import onnx_ir as ir

    graph = program.model.graph
    for node in list(graph):
        if node.op_type != "RMSNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        x, scale = node.inputs[0], node.inputs[1]
        if x.dtype is None or scale.dtype is None or x.dtype == scale.dtype:
            continue
        cast = ir.node("Cast", [x], attributes={"to": scale.dtype}, name=f"{node.name}_input_cast")
        cast.outputs[0].dtype, cast.outputs[0].shape = scale.dtype, x.shape
        graph.insert_before(node, cast)
        node.replace_input_with(0, cast.outputs[0])
        node.outputs[0].dtype = scale.dtype


def _attach_functions(program, opset: int) -> None:
    """Give every ``dspark`` node type used in the graph its model-local function, its body at the
    model's opset (the bodies only use ops whose semantics are the same in 23 and 24)."""
    import onnx_ir as ir

    used = {node.op_type for node in program.model.graph.all_nodes() if node.domain == "dspark"}
    functions = (block_attention_onnx.BlockAttention, cache_write_onnx.CacheWrite, d2t_gather_onnx.D2TGather,
                 gated_delta_onnx.GatedDeltaRule, moe_onnx.MoeExperts)
    for function in functions:
        if function.name in used:
            ir_function = ir.serde.deserialize_function(function.to_function_proto())
            ir_function.opset_imports[""] = opset
            program.model.functions[ir_function.identifier()] = ir_function
