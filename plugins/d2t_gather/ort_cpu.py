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
    base, first, top_k, d2t, w1, weight = found
    graph = model.graph
    outputs = {value.name: value for value in graph.outputs}
    inputs = {value.name: value for value in graph.inputs}
    name = "markov_w2_markov_sampler" if top_k else "markov_w2_t_markov_sampler"
    node = ir.node(OP, [base, inputs["anchor"], inputs["temperature"], inputs["noise"], d2t, w1,
                        placeholder(graph, name, weight, location)],
                   domain=CPU_DOMAIN, num_outputs=2, attributes={"first": first, "top_k": top_k},
                   name="markov_sampler")
    old = [outputs["tokens"], outputs["q"]]
    ir.convenience.replace_nodes_and_values(graph, base.producer(), [], [node], old, list(node.outputs))
    model.opset_imports[CPU_DOMAIN] = 1
    onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
    return {name: weight}


def _sampler(graph):
    """``(base, first, top_k, d2t, markov_w1, markov_w2's array)`` of the unrolled sampler: the base
    logits ``[B, R, Vd]`` whose rows ``first ..`` the drafts read, the candidates per draft (0: all),
    the two constants, and ``markov_w2`` as the kernel reads it (transposed ``[r, Vd]``, or as it
    is ``[Vd, r]`` with top_k); None where the graph is not of that form."""
    import onnx_ir as ir

    gathers = [node for node in graph if node.op_type == NAME]
    names = {value.name for value in graph.inputs} | {value.name for value in graph.outputs}
    if not gathers or not {"anchor", "temperature", "noise", "tokens", "q"} <= names:
        return None
    d2t, w1 = gathers[0].inputs[1:3]
    if any(g.inputs[1] is not d2t or g.inputs[2] is not w1 for g in gathers) or d2t.const_value is None \
            or w1.const_value is None:
        return None
    floats = [w1, *(value for value in graph.inputs if value.name in ("temperature", "noise"))]
    if any(value.dtype != ir.DataType.FLOAT for value in floats):
        return None   # the kernel's are float32 (an fp16 draft keeps its graph)
    top_k = [node for node in graph if node.op_type == "TopK"]
    if top_k:
        found = _top_k_sampler(top_k)
        return None if found is None else (found[0], 0, found[1], d2t, w1, found[2])
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
    if w2t is None or w2t.dtype != np.float32 or base.dtype != ir.DataType.FLOAT:
        return None
    return base, second - 1, 0, d2t, w1, w2t


def _top_k_sampler(top_k):
    """``(base, K, markov_w2 [Vd, r])`` of ``DraftStep.sample``'s top-K form: one ``TopK`` over the
    drafts' rows of base logits (so ``first`` is 0), whose candidate ids gather ``markov_w2``'s
    rows; None for anything else."""
    import onnx_ir as ir

    if len(top_k) != 1:
        return None
    node = top_k[0]
    base, count = node.inputs[0], node.inputs[1].const_value
    weights = [use.node for use in node.outputs[1].uses() if use.node.op_type == "Gather" and use.idx == 1
               and use.node.attributes.get_int("axis", 0) == 0 and use.node.inputs[0].const_value is not None]
    if count is None or len(weights) != 1 or node.attributes.get_int("axis", -1) not in (-1, 2) \
            or node.attributes.get_int("largest", 1) != 1 or base.dtype != ir.DataType.FLOAT:
        return None
    w2 = np.ascontiguousarray(weights[0].inputs[0].const_value.numpy())
    if w2.dtype != np.float32 or w2.ndim != 2:
        return None
    return base, int(count.numpy().reshape(-1)[0]), w2


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
