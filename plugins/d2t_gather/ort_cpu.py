"""The draft's Markov sampler as one compiled op, ``dspark.cpu::MarkovSampler`` (``cpu_kernel.cpp``).

An engine's draft graph holds the sampler unrolled (``DraftStep.sample``): per draft, the Markov
bias ``markov_w1[prev] @ markov_w2^T`` added to its block row of base logits, the temperature,
the softmax scattered into the target vocabulary, the noise and a ``D2TGather``; ~60 small nodes
in all, each of which costs ONNX Runtime more to dispatch than to compute on a CPU. This rewrite,
made when the graph is loaded with the compiled library (as ``block_attention/ort_cpu.py``'s), puts
one node in their place, which reads the base logits and writes the graph's ``tokens`` and ``q``;
the engine file keeps the portable form.
"""
from __future__ import annotations

import numpy as np

from ..qmatmul.ort_lowering import placeholder
from . import NAME

CPU_DOMAIN, OP = "dspark.cpu", "MarkovSampler"


def lower(model, location: str) -> dict[str, np.ndarray]:
    """Replace the sampler that feeds ``model``'s ``tokens`` and ``q`` outputs by one
    ``MarkovSampler``; returns its new weight (``markov_w2`` transposed) by name, as
    ``qmatmul.lower`` does (``location``: the file its placeholder names), or nothing where the
    graph has no sampler of the form ``DraftStep.sample`` exports (it is then left as it is)."""
    import onnx_ir as ir
    import onnx_ir.passes.common

    found = _sampler(model.graph)
    if found is None:
        return {}
    base, first, d2t, w1, transposed = found
    graph = model.graph
    outputs = {value.name: value for value in graph.outputs}
    inputs = {value.name: value for value in graph.inputs}
    name = "markov_w2_t_markov_sampler"
    node = ir.node(OP, [base, inputs["anchor"], inputs["temperature"], inputs["noise"], d2t, w1,
                        placeholder(graph, name, transposed, location)],
                   domain=CPU_DOMAIN, num_outputs=2, attributes={"first": first}, name="markov_sampler")
    old = [outputs["tokens"], outputs["q"]]
    ir.convenience.replace_nodes_and_values(graph, base.producer(), [], [node], old, list(node.outputs))
    model.opset_imports[CPU_DOMAIN] = 1
    onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
    return {name: transposed}


def _sampler(graph):
    """``(base, first, d2t, markov_w1, markov_w2^T)`` of the unrolled sampler: the base logits
    ``[B, R, Vd]`` whose rows ``first ..`` the drafts read, the two constants and the transposed
    weight as an array; None where the graph is not of that form."""
    import onnx_ir as ir

    gathers = [node for node in graph if node.op_type == NAME]
    names = {value.name for value in graph.inputs} | {value.name for value in graph.outputs}
    if not gathers or not {"anchor", "temperature", "noise", "tokens", "q"} <= names:
        return None
    d2t, w1 = gathers[0].inputs[1:3]
    if any(g.inputs[1] is not d2t or g.inputs[2] is not w1 for g in gathers) or d2t.const_value is None \
            or w1.const_value is None:
        return None
    # draft i > 0's bias: MatMul(the previous draft's Markov row, markov_w2^T); its block row: the
    # other input of the Add after it, Gather(base, first + i, axis=1)
    rows = []
    for previous in gathers[:-1]:
        product = next((use.node for use in previous.outputs[1].uses() if use.node.op_type == "MatMul"), None)
        add = _only_use(product)
        if product is None or add is None or add.op_type != "Add":
            return None
        gather = add.inputs[0].producer() if add.inputs[1] is product.outputs[0] else add.inputs[1].producer()
        if gather is None or gather.op_type != "Gather" or gather.attributes.get_int("axis", 0) != 1 \
                or gather.inputs[1].const_value is None:
            return None
        rows.append((gather.inputs[0], int(gather.inputs[1].const_value.numpy()), product.inputs[1]))
    if not rows:
        return None
    base, second, product = rows[0]
    if (any(b is not base or p is not product for b, _, p in rows)
            or [row for _, row, _ in rows] != list(range(second, second + len(rows)))):
        return None
    w2t = _transposed(product)
    floats = [base, w1, *(value for value in graph.inputs if value.name in ("temperature", "noise"))]
    if w2t is None or w2t.dtype != np.float32 or any(value.dtype != ir.DataType.FLOAT for value in floats):
        return None   # the kernel's are float32 (an fp16 draft keeps its graph)
    return base, second - 1, d2t, w1, w2t


def _transposed(value):
    """``markov_w2`` transposed, ``[r, Vd]``, of the product's constant: ``Transpose(markov_w2)``,
    or the transposed weight itself where the export folded it; None for anything else."""
    if value.const_value is not None:
        return np.ascontiguousarray(value.const_value.numpy())
    transpose = value.producer()
    if transpose is None or transpose.op_type != "Transpose" or transpose.inputs[0].const_value is None:
        return None
    return np.ascontiguousarray(transpose.inputs[0].const_value.numpy().T)


def _only_use(node):
    """The one node reading ``node``'s one output, or None."""
    if node is None or len(node.outputs[0].uses()) != 1:
        return None
    return node.outputs[0].uses()[0].node
