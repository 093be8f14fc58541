"""A traced graph's linear layers rewritten to hold quantized weights (``build --weights``), as
standard ONNX: a blocked ``DequantizeLinear`` (int4 / int8 weight, one scale per block, no zero
point) feeding a ``MatMul``, which ONNX Runtime fuses into ``MatMulNBits`` on the CPU and
TensorRT-RTX builds as a weight-only quantized layer, its weights kept int4 / int8 in the engine
(``tests/graphs/test_tensorrt_build.py``). The blocks come from ``quantize.rtn_blocks`` or a GGUF file
(``gguf_blocks.py``).

The rewrite is ours rather than ONNX Runtime's tool, whose QDQ path refuses 8 bits, skips ``Gemm``
(the target's ``lm_head``) and writes a weight that several MatMuls share (the draft's K/V
projections) once per use. Function bodies (the ``dspark`` nodes') are not touched; a MoE layer's
experts (``dspark::MoeExperts``, most of such a target's weights) become ``MoeExpertsInt4`` /
``Int8``, which gather the integers and blocks of the experts a step selects and de-quantize only
those (``plugins/moe/onnx_function.py``).
"""
from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Set
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from export.quantize import Blocks, BlocksOf
from plugins.qmatmul.layout import KQuantScales
from plugins.qmatmul.ort_lowering import linear_weight


def quantize_graph(path: Path, blocks_of: BlocksOf,
                   keep: Set[str] = frozenset(),
                   embeddings: BlocksOf | None = None,
                   kquant_scales: bool = True) -> int:
    """``quantize_model`` of the graph written at ``path`` (and its ``.data`` file); returns how
    many layers it rewrote. The weights are read mapped from the old file while the new one is
    written beside it, then the new one takes its place."""
    import onnx_ir as ir

    model = ir.load(path)
    replaced = quantize_model(model, path, blocks_of, keep, embeddings, kquant_scales)
    staging = path.parent / f".{path.name}.quantized"
    staging.mkdir()
    try:
        ir.save(model, staging / path.name, external_data=f"{path.name}.data")
        del model
        for name in (path.name, f"{path.name}.data"):
            (staging / name).replace(path.parent / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return replaced


def quantize_model(model, path: Path, blocks_of: BlocksOf,
                   keep: Set[str] = frozenset(),
                   embeddings: BlocksOf | None = None,
                   kquant_scales: bool = True) -> int:
    """Rewrite ``model`` (``onnx_ir``, to be written at ``path``) with every linear layer of the
    main graph for which ``blocks_of(weight [K, N])`` gives blocks, and whose weight is not named
    in ``keep``, as ``DequantizeLinear -> MatMul`` (plus, where the blocks have offsets, the
    input's per-block sums times the offsets); returns how many.
    A linear layer is a ``MatMul`` with a constant 2-D weight, or a ``Gemm(transB=1)`` (the weight
    stored ``[N, K]``). Layers that read the same input (q / k / v, gate / up) become one product
    with their weights side by side, split after it: one kernel call instead of two or three
    (docs/measurements.md). The blocks' values wait in a scratch file beside ``path`` until the
    graph is written (``_Spill``).
    With ``embeddings`` (the blocks of a table ``[K, V]``, which must give the values the table
    holds: a file's own, or a rounding the module was given first), a ``Gather`` of a float
    table's rows is rewritten too (``_quantize_embeddings``); it is not counted.
    A GGUF K-quant's scales and offsets are made in the graph from the file's integers
    (``_kquant_scales``: the kernel reads those, a Q4_K weight's bytes 0.77x) unless
    ``kquant_scales`` is False (TensorRT engines, whose weight-only layers take constant scales)."""
    rewrite = _Rewrite(model.graph, blocks_of, path.name, kquant_scales, _Spill(path.parent))
    pending, replaced = _linear_groups(model.graph, keep), 0
    while pending:
        group = pending.pop(0)
        if rewrite.replace(group):
            replaced += len(group)
        elif len(group) > 1:   # e.g. one of them is not the GGUF file's: each on its own
            pending[:0] = [[member] for member in group]
    replaced += 2 * _quantize_experts(model, blocks_of)
    if embeddings is not None:
        _quantize_embeddings(model.graph, embeddings)
    _weights_first(model.graph)
    return replaced


class _Rewrite:
    """``quantize_graph``'s edits of one graph: a group of linear layers at a time."""

    def __init__(self, graph, blocks_of: BlocksOf, file: str, kquant_scales: bool, spill: _Spill):
        self.graph, self.blocks_of, self.file, self.kquant_scales = graph, blocks_of, file, kquant_scales
        self.spill = spill
        self.dequantized: dict[tuple, tuple] = {}   # weights -> (name, Stored): a shared weight once
        self.readers: Counter[str] = Counter()       # products made so far that read each
        self.block_sums: dict[tuple[str, int], object] = {}   # (input, block) -> its block sums, once

    def replace(self, group: list[tuple]) -> bool:
        """Replace ``group``'s layers ``(node, weight, transposed)``, which read one input, by one
        product (False, nothing changed, when ``blocks_of`` gives no blocks for their weights)."""
        import onnx_ir as ir

        new_nodes = []
        found = self._dequantize(group, new_nodes)
        if found is None:
            return False
        weight_values, offsets = found
        nodes = [node for node, _, _ in group]
        x = nodes[0].inputs[0]
        name = "_".join(node.name or weight.name for node, weight, _ in group)
        matmul = ir.node("MatMul", [x, weight_values], name=name)
        new_nodes.append(matmul)
        result = matmul.outputs[0]
        if offsets is not None:   # + (x summed over each block of the input axis) @ offsets
            block = weight_values.producer().attributes["block_size"].value
            offset = ir.node("MatMul", [self._block_sums(x, block, name, new_nodes), offsets],
                             name=f"{name}_offsets")
            add = ir.node("Add", [result, offset.outputs[0]], name=f"{name}_add_offsets")
            new_nodes += [offset, add]
            result = add.outputs[0]
        results = [result]
        if len(group) > 1:
            widths = [weight.const_value.shape[0 if transposed else 1] for _, weight, transposed in group]
            sizes = _initializer(self.graph, f"{name}_widths", np.array(widths, np.int64))
            split = ir.node("Split", [result, sizes], attributes={"axis": -1}, num_outputs=len(group),
                            name=f"{name}_split")
            new_nodes.append(split)
            results = list(split.outputs)
        for index, node in enumerate(nodes):
            if len(node.inputs) > 2 and node.inputs[2] is not None:   # a Gemm's bias
                add = ir.node("Add", [results[index], node.inputs[2]], name=f"{node.name}_bias")
                new_nodes.append(add)
                results[index] = add.outputs[0]
        feeds = [node.inputs[1] for node in nodes]   # the weights, or a shared weight's Transpose
        ir.convenience.replace_nodes_and_values(self.graph, nodes[0], nodes, new_nodes,
                                                [node.outputs[0] for node in nodes], results)
        for feed in feeds:
            if not feed.is_initializer() and not feed.uses():
                self.graph.remove(feed.producer(), safe=True)
        for _, weight, _ in group:
            if not weight.uses():
                self.graph.initializers.pop(weight.name)
        return True

    def _dequantize(self, group: list[tuple], new_nodes: list) -> tuple | None:
        """``(weights side by side [K, sum N] as DequantizeLinear's output, offsets or None)``.
        A weight that several products read (the draft's K/V projections) is quantized once,
        and each product reads a copy of its blocks through a ``DequantizeLinear`` of its own:
        ONNX Runtime fuses one into ``MatMulNBits`` only where the product is the one reader of it
        and of its blocks, and otherwise de-quantizes the whole weight at every step."""
        import onnx_ir as ir

        key = tuple((weight.name, transposed) for _, weight, transposed in group)
        if key not in self.dequantized:
            matrices = [weight.const_value.numpy().T if transposed else weight.const_value.numpy()
                        for _, weight, transposed in group]
            # one weight as the view it is (of the mapped file): a vocabulary-sized lm_head's copy
            # was the rewrite's largest allocation; blocks_of reads some columns at a time
            blocks = self.blocks_of(matrices[0] if len(matrices) == 1 else np.concatenate(matrices, axis=1))
            if blocks is None:
                return None
            fused = "_fused" if len(group) > 1 else ""
            self.dequantized[key] = (f"{key[0][0]}{'_t' if key[0][1] else ''}{fused}_int{blocks.bits}",
                                     Stored.of(blocks, self.kquant_scales, self.spill))
        stem, stored = self.dequantized[key]
        reader, self.readers[stem] = self.readers[stem], self.readers[stem] + 1
        stem += f"_{reader}" if reader else ""
        if stored.kquant is not None:
            scales, offsets = _kquant_scales(self.graph, stem, stored.kquant, new_nodes)
        else:
            scales = _initializer(self.graph, f"{stem}_scales", stored.scales)
            offsets = None if stored.offsets is None else _initializer(self.graph, f"{stem}_offsets",
                                                                       stored.offsets)
        q = _registered(self.graph, stored.integers(f"{stem}_q"))
        dq = ir.node("DequantizeLinear", [q, scales],
                     attributes={"axis": 0, "block_size": stored.block}, name=f"{stem}_dequantize")
        new_nodes.append(dq)
        return dq.outputs[0], offsets

    def _block_sums(self, x, block: int, name: str, new_nodes: list):
        """``x [..., K]`` summed over each block of ``block`` values: ``[..., K / block]``."""
        import onnx_ir as ir

        if (x.name, block) not in self.block_sums:
            if x.shape is None:
                raise ValueError(f"{self.file}: {name}'s input has no known rank")
            shape = [0] * (len(x.shape) - 1) + [-1, block]
            reshape = ir.node("Reshape", [x, _initializer(self.graph, f"{x.name}_blocks_{block}_shape",
                                                          np.array(shape, np.int64))])
            reduce = ir.node("ReduceSum", [reshape.outputs[0], _initializer(
                self.graph, f"{x.name}_blocks_{block}_axis", np.array([-1], np.int64))],
                             attributes={"keepdims": 0})
            new_nodes += [reshape, reduce]
            self.block_sums[(x.name, block)] = reduce.outputs[0]
        return self.block_sums[(x.name, block)]


def _weights_first(graph) -> None:
    """Move the nodes that compute from weights alone (each weight's ``DequantizeLinear``, a
    K-quant's scales) to the front of the graph. ONNX Runtime's default order is a depth-first
    walk up from the outputs that takes a node's highest-indexed producer first: a weight's chain
    placed after the activations' producers ran before them, at the very start, and every weight
    so reached was held de-quantized to the end (at 8B, the Q6_K ``lm_head`` and half the
    ``down_proj``s: 6.4 GB in float32). Placed first, each chain runs just before its product."""
    computed = set(graph.initializers.values())
    first = []
    for node in graph:
        if all(value is None or value in computed for value in node.inputs):
            first.append(node)
            computed.update(node.outputs)
    moved = set(first)
    rest = [node for node in graph if node not in moved]
    if first and rest:
        graph.remove(first)
        graph.insert_before(rest[0], first)


def _kquant_scales(graph, stem: str, kquant: KQuantScales, new_nodes: list) -> tuple:
    """A K-quant's scales and offsets as the graph's values, made from the file's integers:
    ``scales = DequantizeLinear(sc, d)`` and (Q4_K / Q5_K) ``offsets = middle * scales -
    DequantizeLinear(m, dmin)``, in blocks of a super-block's sub-blocks along the input axis, each
    product exact in float32, so the same values as constant tables of them (``KQuantScales``),
    which ``plugins/qmatmul/ort_lowering.py`` finds."""
    import onnx_ir as ir

    def dequantize(integers: str, scale: str, values: np.ndarray, per_super: np.ndarray):
        node = ir.node("DequantizeLinear", [_initializer(graph, f"{stem}_{integers}", values),
                                            _initializer(graph, f"{stem}_{scale}", per_super)],
                       attributes={"axis": 0, "block_size": len(values) // len(per_super)},
                       name=f"{stem}_{integers}_dequantize")
        new_nodes.append(node)
        return node.outputs[0]

    scales = dequantize("sc", "d", kquant.sc, kquant.d)
    if kquant.m is None:   # Q6_K
        return scales, None
    middle = _initializer(graph, f"{stem}_middle", np.array(kquant.middle, np.float32))
    shifted = ir.node("Mul", [scales, middle], name=f"{stem}_middle_scales")
    offsets = ir.node("Sub", [shifted.outputs[0], dequantize("m", "dmin", kquant.m, kquant.dmin)],
                      name=f"{stem}_offsets")
    new_nodes += [shifted, offsets]
    return scales, offsets.outputs[0]


def _quantize_embeddings(graph, blocks_of: BlocksOf) -> None:
    """Rewrite each ``Gather`` of a float ``[V, K]`` table's rows (the token embeddings) whose rows
    have blocks as a gather of the rows' integers (int8, one a value) and scales, de-quantized
    after: ``d * q`` (plus a Q4_1 block's offset), the values it held. A GGUF file's tied embedding
    is the output layer too, which the engine already holds as blocks; kept as float32 it was the
    largest tensor of a small target (622 MB at 151936 x 1024, against 165 MB as Q8_0)."""
    import onnx_ir as ir

    for node in [n for n in graph if n.op_type == "Gather" and n.attributes.get_int("axis", 0) == 0]:
        table, ids = node.inputs[0], node.inputs[1]
        if not table.is_initializer() or table.const_value is None or table.dtype != ir.DataType.FLOAT \
                or len(table.shape) != 2 or ids.shape is None:
            continue
        blocks = blocks_of(table.const_value.numpy().T)   # its rows as columns, a view
        if blocks is None:
            continue
        stem, kept = f"{table.name}_rows", [0] * len(ids.shape)   # Reshape's 0: the ids' own dimensions
        new_nodes, integers = _gathered(graph, f"{stem}_q", blocks.q, ids)
        cast = ir.node("Cast", [integers], attributes={"to": ir.DataType.FLOAT})
        blocked = ir.node("Reshape", [cast.outputs[0], _initializer(
            graph, f"{stem}_blocked", np.array(kept + [-1, blocks.block], np.int64))])
        scale_nodes, scales = _gathered(graph, f"{stem}_scales", blocks.scales, ids, unsqueeze=True)
        values = ir.node("Mul", [blocked.outputs[0], scales])
        new_nodes += [cast, blocked, *scale_nodes, values]
        if blocks.offsets is not None:
            offset_nodes, offsets = _gathered(graph, f"{stem}_offsets", blocks.offsets, ids, unsqueeze=True)
            values = ir.node("Add", [values.outputs[0], offsets])
            new_nodes += [*offset_nodes, values]
        flat = ir.node("Reshape", [values.outputs[0], _initializer(
            graph, f"{stem}_flat", np.array(kept + [table.shape[1]], np.int64))])
        new_nodes.append(flat)
        ir.convenience.replace_nodes_and_values(graph, node, [node], new_nodes, node.outputs, flat.outputs)
        if not table.uses():
            graph.initializers.pop(table.name)


def _gathered(graph, name: str, columns: np.ndarray, ids, unsqueeze: bool = False) -> tuple[list, object]:
    """The rows ``ids`` of ``columns [., V]`` stored as rows (``name``), with a last axis of one
    added where ``unsqueeze`` (a scale per block, against the block's values): ``(nodes, value)``."""
    import onnx_ir as ir

    table = _initializer(graph, name, np.ascontiguousarray(columns.T))
    nodes = [ir.node("Gather", [table, ids], attributes={"axis": 0}, name=f"{name}_gather")]
    if unsqueeze:
        nodes.append(ir.node("Unsqueeze", [nodes[-1].outputs[0], _initializer(
            graph, f"{name}_axis", np.array([-1], np.int64))]))
    return nodes, nodes[-1].outputs[0]


def _quantize_experts(model, blocks_of: BlocksOf) -> int:
    """Rewrite each ``dspark::MoeExperts`` node whose two expert stacks are constants and have
    blocks as ``MoeExpertsInt{bits}`` (``plugins/moe/onnx_function.py``); returns how many."""
    import onnx_ir as ir

    from plugins.moe import MATRICES
    from plugins.moe import onnx_function as moe
    from plugins.onnx_domain import DOMAIN

    graph, replaced, used = model.graph, 0, set()
    for node in [n for n in graph if n.domain == DOMAIN and n.op_type == moe.NAME]:
        stacks = [node.inputs[moe.INPUTS.index(m)] for m in MATRICES]
        if not all(s.is_initializer() and s.const_value is not None for s in stacks):
            continue
        quantized = [expert_blocks(s.const_value.numpy(), blocks_of) for s in stacks]
        if None in quantized:
            continue
        bits = quantized[0][2]
        inputs = list(node.inputs[:3])
        for stack, (q, scales, _) in zip(stacks, quantized):
            inputs += [_initializer(graph, f"{stack.name}_int{bits}", q),
                       _initializer(graph, f"{stack.name}_scales", scales)]
        new = ir.node(f"{moe.NAME}Int{bits}", inputs, domain=DOMAIN, name=node.name,
                      attributes={k: a.value for k, a in node.attributes.items()})
        ir.convenience.replace_nodes_and_values(graph, node, [node], [new], node.outputs, new.outputs)
        for stack in stacks:
            if not stack.uses():
                graph.initializers.pop(stack.name)
        used.add(bits)
        replaced += 1
    if replaced:
        if not any(n.op_type == moe.NAME for n in graph if n.domain == DOMAIN):
            model.functions.pop((DOMAIN, moe.NAME, ""), None)
        for bits in used:
            function = ir.serde.deserialize_function(moe.quantized_function(bits))
            function.opset_imports[""] = model.opset_imports[""]
            model.functions[function.identifier()] = function
    return replaced


def expert_blocks(stack: np.ndarray, blocks_of: BlocksOf):
    """``stack [E, N, K]`` (each expert's matrix as ``nn.Linear`` stores it) -> ``(q, scales
    [E, K / b, N], bits)`` in ``MoeExpertsInt{bits}``'s layout: ``q`` int8 ``[E, K / b, b, N]``,
    or for int4 ``[E, K / b, b / 2, N]`` bytes, their bits as int8 (block row ``j`` low, ``j + b / 2``
    high, plus 8); None where an expert has no blocks."""
    q = scales = None
    for expert, matrix in enumerate(stack):
        blocks = blocks_of(np.ascontiguousarray(matrix.T))
        if blocks is None or blocks.offsets is not None:
            return None
        integers = blocks.q.reshape(blocks.scales.shape[0], blocks.block, -1)   # [K/b, b, N]
        if blocks.bits == 4:
            unsigned = (integers + 8).astype(np.uint8)
            half = blocks.block // 2
            integers = (unsigned[:, :half] | (unsigned[:, half:] << 4)).view(np.int8)   # the bits as int8
        if q is None:
            q = np.empty((len(stack), *integers.shape), integers.dtype)
            scales = np.empty((len(stack), *blocks.scales.shape), blocks.scales.dtype)
        q[expert], scales[expert] = integers, blocks.scales
    return q, scales, blocks.bits


def _linear_groups(graph, keep: Set[str]) -> list[list[tuple]]:
    """The graph's linear layers as ``(node, weight, stored transposed)``, in order, but those
    whose weight is named in ``keep``; the layers that read the same input, each with a weight of
    its own and of the same input size, in one group."""
    groups: dict[object, list[tuple]] = {}
    for node in graph:
        found = linear_weight(node)
        if found is None or found[0].name in keep:
            continue
        weight, transposed = found
        size = weight.const_value.shape[1 if transposed else 0]
        # a weight shared between layers stays alone
        key = (node.inputs[0].name, size) if len(node.inputs[1].uses()) == 1 else node
        groups.setdefault(key, []).append((node, weight, transposed))
    return list(groups.values())


def _initializer(graph, name: str, array: np.ndarray):
    import onnx_ir as ir

    return _registered(graph, ir.Tensor(array, name=name))


def _registered(graph, tensor):
    """``tensor`` as an initializer of ``graph`` (its name the tensor's)."""
    import onnx_ir as ir

    value = ir.Value(name=tensor.name, const_value=tensor)
    graph.register_initializer(value)
    return value


@dataclass(frozen=True)
class Stored:
    """What the graph stores of one weight's ``Blocks``, kept until the graph is written: the
    values (int4 two to a byte) in the rewrite's scratch file (``_Spill``), and a K-quant's scales
    as the file's integers rather than float32 tables of them."""
    q: np.ndarray                  # int8 [K, N], or int4 values two to a byte
    shape: tuple[int, int]         # [K, N]
    bits: int
    block: int
    scales: np.ndarray | None      # None where made from ``kquant``
    offsets: np.ndarray | None
    kquant: KQuantScales | None

    @staticmethod
    def of(blocks: Blocks, kquant_scales: bool, spill: _Spill) -> Stored:
        """``blocks`` as the graph stores them, the values ``spill``ed; with ``kquant_scales``, a
        K-quant's scales and offsets are made in the graph (``_kquant_scales``)."""
        q = blocks.q
        if blocks.bits == 4:   # element 2i in the low nibble, as ONNX packs int4
            nibbles = q.reshape(-1).view(np.uint8) & 0x0F
            q = nibbles[0::2] | (nibbles[1::2] << 4)
        q = spill(q)
        if blocks.kquant is not None and kquant_scales:
            return Stored(q, blocks.q.shape, blocks.bits, blocks.block, None, None, blocks.kquant)
        return Stored(q, blocks.q.shape, blocks.bits, blocks.block, blocks.scales, blocks.offsets, None)

    def integers(self, name: str):
        """The values as a tensor of the ONNX type of their width."""
        import onnx_ir as ir

        if self.bits == 4:
            return ir.PackedTensor(self.q, ir.DataType.INT4, shape=self.shape, name=name)
        return ir.Tensor(self.q, name=name)


class _Spill:
    """The rewrite's weight values, written to a scratch file as each is made and mapped back
    until the graph is written: in memory they were the whole model's blocks at once (5 GB of an
    8B Q4_K_M target), where mapped pages are the system's to reclaim. The file is in the graph's
    folder (the system's temporary folder may be memory) and has no name: it goes with its last
    mapping, however the build ends."""

    def __init__(self, folder: Path):
        self.file = tempfile.TemporaryFile(dir=folder)

    def __call__(self, array: np.ndarray) -> np.ndarray:
        if not array.nbytes:
            return array
        array = np.ascontiguousarray(array)
        # a mapping starts at a multiple of the system's granularity
        start = -(-self.file.seek(0, os.SEEK_END) // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
        self.file.seek(start)
        self.file.write(array.reshape(-1).view(np.uint8).data)
        self.file.flush()
        mapped = mmap.mmap(self.file.fileno(), array.nbytes, access=mmap.ACCESS_READ, offset=start)
        return np.frombuffer(mapped, array.dtype).reshape(array.shape)
