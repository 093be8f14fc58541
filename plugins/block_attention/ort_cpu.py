"""The batched CPU forms of ``BlockAttention``: ``dspark.cpu::CausalAttention`` (the target's
causal attention) and ``dspark.cpu::DraftAttention`` (the draft's ``CacheWrite`` of its context
rows and its non-causal block attention, one op) (``cpu_kernel.cpp``), which run every sequence of
a call over its own cache slot and its own visible rows, so a step of several sequences is one
ONNX Runtime call whose rows each compute what they compute alone. The caches become a pool of
slots: batch row ``b`` reads and writes slot ``slots[b]`` (a new graph input), so a step may run
any subset of the pool's sequences.

ONNX Runtime's own kernels cannot do this (``runtime/backends/ort.py`` says why); the rewrite is
made when a graph is loaded with the compiled library, as ``ort_contrib.py``'s is.
"""
from __future__ import annotations

from ..cache_write import NAME as CACHE_WRITE
from ..d2t_gather import NAME as D2T_GATHER
from ..onnx_domain import DOMAIN
from . import NAME

CPU_DOMAIN, OP, DRAFT_OP = "dspark.cpu", "CausalAttention", "DraftAttention"
SLOTS = "slots"
# the custom ops a pooled graph may hold besides: each computes a row alone (D2TGather's body is
# gathers), where a hybrid's recurrence or MoE experts would still follow the call's batch
ROW_WISE = {NAME, CACHE_WRITE, D2T_GATHER}


def lower(model) -> bool:
    """Replace every ``BlockAttention`` of ``model``'s main graph by its form over a pool of slots
    and add the ``slots [batch]`` input; False, unchanged, unless every one is float32 without a
    sliding window and either causal on caches that are graph inputs (a dense decoder target) or
    non-causal on caches that a ``CacheWrite`` of a graph input made (the draft), and the graph has
    no other custom op or cache (a hybrid, MoE or Gemma 4 target, or an fp16 graph, keeps its
    form)."""
    import onnx_ir as ir

    graph = model.graph
    nodes = [node for node in graph if node.domain == DOMAIN and node.op_type == NAME]
    inputs = {value.name for value in graph.inputs}
    pooled = [_pooled(node, inputs) for node in nodes]
    if not nodes or None in pooled:
        return False
    caches = {cache for node_caches, _ in pooled for cache in node_caches}
    if (any(node.domain == DOMAIN and node.op_type not in ROW_WISE for node in graph)
            or {value for value in graph.inputs if "_cache_" in value.name} != caches):
        return False
    # the tracer reads the batch size off a cache; it is the call's, the caches the pool's
    batch_sizes = [node for cache in caches for node in (use.node for use in cache.uses())
                   if node.op_type == "Shape"]
    if any(node.attributes.get_int("start", 0) != 0 or node.attributes.get_int("end", 0) != 1
           for node in batch_sizes) or any(len(cache.uses()) != 1 + sum(node.inputs[0] is cache for node in
                                                                        batch_sizes) for cache in caches):
        return False
    first = graph.inputs[0]
    for node in batch_sizes:
        node.replace_input_with(0, first)
    slots = ir.Value(name=SLOTS, shape=ir.Shape([first.shape[0]]), type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.append(slots)
    for node, (node_caches, writes) in zip(nodes, pooled):
        for cache in node_caches:   # the pool's size, not the call's batch
            cache.shape = ir.Shape(["pool", *cache.shape[1:]])
        inputs = [*node.inputs[:3], *node_caches, node.inputs[5], slots]
        if writes:   # the context rows and where they go
            inputs += [writes[0].inputs[1], writes[1].inputs[1], writes[0].inputs[2]]
        attention = ir.node(DRAFT_OP if writes else OP, inputs, domain=CPU_DOMAIN, num_outputs=3,
                            attributes={"scale": node.attributes["scale"].value}, name=f"{node.name}_cpu")
        ir.convenience.replace_nodes_and_values(graph, node, [node, *writes], [attention], list(node.outputs),
                                                list(attention.outputs))
    for output in graph.outputs:
        if output.name.startswith(("k_cache", "v_cache")) and output.shape is not None:
            output.shape = ir.Shape(["pool", *output.shape[1:]])
    model.opset_imports[CPU_DOMAIN] = 1
    return True


def _pooled(node, inputs: set[str]):
    """``((k, v), writes)``: the graph's cache inputs ``node`` reads and the ``CacheWrite`` nodes
    between (none for a causal node); None where the node has no pooled form."""
    import onnx_ir as ir

    if node.inputs[0].dtype != ir.DataType.FLOAT or node.attributes.get_int("window", 0):
        return None
    k, v = node.inputs[3:5]
    if node.attributes["causal"].value:
        return ((k, v), []) if k.name in inputs and v.name in inputs else None
    writes = [k.producer(), v.producer()]
    if any(write is None or write.domain != DOMAIN or write.op_type != CACHE_WRITE
           or write.inputs[0].name not in inputs or len(write.outputs[0].uses()) != 1 for write in writes):
        return None
    if writes[0].inputs[2] is not writes[1].inputs[2]:   # one start for the context's K and V rows
        return None
    return (writes[0].inputs[0], writes[1].inputs[0]), writes
