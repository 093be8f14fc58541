"""The batched CPU form of the target's causal ``BlockAttention``: ``dspark.cpu::CausalAttention``
(``cpu_kernel.cpp``), which runs every sequence of a call over its own cache slot and its own
visible rows, so a step of several sequences is one ONNX Runtime call whose rows each compute
what they compute alone. The caches become a pool of slots: batch row ``b`` reads and writes
slot ``slots[b]`` (a new graph input), so a step may run any subset of the pool's sequences.

ONNX Runtime's own kernels cannot do this (``runtime/ort_backend.py`` says why); the rewrite is
made when a graph is loaded with the compiled library, as ``ort_contrib.py``'s is.
"""
from __future__ import annotations

from ..onnx_domain import DOMAIN
from . import NAME

CPU_DOMAIN, OP = "dspark.cpu", "CausalAttention"
SLOTS = "slots"


def lower(model) -> bool:
    """Replace every ``BlockAttention`` of ``model``'s main graph by ``CausalAttention`` over a
    pool of slots and add the ``slots [batch]`` input; False, unchanged, unless every one is
    causal without a sliding window, float32, and reads its caches straight from the graph's
    inputs, and the graph has no other custom op or cache (the target of a dense decoder: a
    hybrid, MoE or Gemma 4 target, an fp16 one, or the draft, keeps its form)."""
    import onnx_ir as ir

    graph = model.graph
    nodes = [node for node in graph if node.domain == DOMAIN and node.op_type == NAME]
    inputs = {value.name for value in graph.inputs}
    if not nodes or not all(node.attributes["causal"].value and not node.attributes.get_int("window", 0)
                            and node.inputs[3].name in inputs and node.inputs[4].name in inputs
                            and node.inputs[0].dtype == ir.DataType.FLOAT for node in nodes):
        return False
    caches = {value for node in nodes for value in node.inputs[3:5]}
    # a dense decoder alone: no other custom op (a hybrid's recurrence, MoE experts) and no other
    # cache (a recurrent state) whose rows would still follow the call's batch
    if (any(node.domain == DOMAIN and node.op_type != NAME for node in graph)
            or {value for value in graph.inputs if "_cache_" in value.name} != caches):
        return False
    # the tracer reads the batch size off a cache; it is the call's, the caches the pool's
    batch_sizes = [node for cache in caches for node in (use.node for use in cache.uses())
                   if node.op_type == "Shape"]
    if any(node.attributes.get_int("start", 0) != 0 or node.attributes.get_int("end", 0) != 1
           for node in batch_sizes) or any(len(cache.uses()) != 1 + sum(node.inputs[0] is cache for node in
                                                                        batch_sizes) for cache in caches):
        return False
    input_ids = graph.inputs[0]
    for node in batch_sizes:
        node.replace_input_with(0, input_ids)
    batch = input_ids.shape[0]
    slots = ir.Value(name=SLOTS, shape=ir.Shape([batch]), type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.append(slots)
    for node in nodes:
        for cache in node.inputs[3:5]:   # the pool's size, not the call's batch
            cache.shape = ir.Shape(["pool", *cache.shape[1:]])
        attention = ir.node(OP, [*node.inputs, slots], domain=CPU_DOMAIN, num_outputs=3,
                            attributes={"scale": node.attributes["scale"].value}, name=f"{node.name}_cpu")
        ir.convenience.replace_nodes_and_values(graph, node, [node], [attention], list(node.outputs),
                                                list(attention.outputs))
    for output in graph.outputs:
        if output.name.startswith(("k_cache", "v_cache")) and output.shape is not None:
            output.shape = ir.Shape(["pool", *output.shape[1:]])
    model.opset_imports[CPU_DOMAIN] = 1
    return True
