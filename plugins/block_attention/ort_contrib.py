"""ONNX Runtime's CPU forms of ``dspark::BlockAttention`` at batch 1: a causal node (the target's)
without a sliding window becomes one ``com.microsoft.GroupQueryAttention`` node, which also
applies the rotary embedding before it; a non-causal one (the draft's block) an ``Attention``
over the rows it sees.

ONNX Runtime runs a ``dspark`` node by inlining its portable function body, about 18 small ops per
layer (write indices, the visible-row count, the mask, two scatters and two slices), and on a small
model those ops, not the matrix products, weigh most in a step (docs/measurements.md, "The demo
pair with quantized weights").
GroupQueryAttention does the same work in one kernel, in place when its past and present caches
are one buffer (the runtime binds them so): it writes each sequence's new K/V rows at ``start``
(its ``seqlens_k + 1 - rows``) and attends causally over the rows before them, the causal pattern
of ``reference.py``. The non-causal pattern has no contrib form; its body copies the cache to
write the block rows that only it reads, and ``_to_attention_over_seen_rows`` hands them to the
attention instead.

The rewrite happens when a graph is loaded, so the engine file stays the portable one that
TensorRT and other runtimes read. Where the caches are not one buffer, GroupQueryAttention copies
only each sequence's valid rows into the present cache: rows from ``start + rows`` on are scratch,
as the operator's contract allows.
"""
from __future__ import annotations

import numpy as np

from ..onnx_domain import DOMAIN
from . import NAME

CONTRIB = "com.microsoft"


def lower(model, rotary: tuple[np.ndarray, np.ndarray] | None = None) -> int:
    """Replace, in ``model`` (``onnx_ir.Model``) main graph, run at batch 1, every ``BlockAttention``
    that has a faster form (``_to_group_query_attention``, ``_to_attention_over_seen_rows``) by it;
    returns how many. ``rotary`` (``rotary_tables``) is the decoder's, for the causal nodes."""
    import onnx_ir.passes.common

    graph, lowered = model.graph, 0
    lengths: dict[tuple, tuple] = {}   # sequence lengths, made once per (start, row count)
    for node in list(graph):
        if node.domain != DOMAIN or node.op_type != NAME:
            continue
        if node.attributes["causal"].value:
            lowered += _to_group_query_attention(graph, node, rotary, lengths)
        else:
            lowered += _to_attention_over_seen_rows(graph, node)
    if lowered:
        model.opset_imports[CONTRIB] = 1
        onnx_ir.passes.common.RemoveUnusedNodesPass()(model)   # the rotations now in the attention
    return lowered


def _to_group_query_attention(graph, node, rotary, lengths: dict) -> bool:
    """A causal node (the target's) whose head counts and size are static as one
    ``GroupQueryAttention``; its sequence lengths are computed once per (``start``, row count)
    that the nodes share. With ``rotary``, a node whose q and k come straight from rotate-half
    ``RotaryEmbedding`` nodes takes them before those and rotates them itself, at the positions
    its sequence lengths give (``start + i``): two ops and their layout changes fewer per layer."""
    import onnx_ir as ir

    q, k_new, v_new, k_cache, v_cache, start = node.inputs
    if not all(_static(value, axis) for value, axis in ((q, 1), (q, 3), (k_cache, 1))):
        return False
    if node.attributes.get_int("window", 0):   # a sliding layer's ring: the cache rows are not positions
        return False
    heads, head_dim, kv_heads = q.shape[1], q.shape[3], k_cache.shape[1]
    new_nodes, tables = [], []
    if rotary is not None and _rotated(q, head_dim) and _rotated(k_new, head_dim):
        q, k_new = q.producer().inputs[0], k_new.producer().inputs[0]
        tables = [_constant(graph, f"rotary_{name}", table.astype(q.dtype.numpy()), None)
                  for name, table in zip(("cos", "sin"), rotary)]
    key = (start.name, str(q.shape[2]) if _symbolic(q, 2) else node.name)
    if key not in lengths:
        lengths[key] = _sequence_lengths(graph, q, start, new_nodes)
    seqlens_k, total = lengths[key]

    def rows_first(x, count):   # [B, H, S, D] -> [B, S, H * D]
        to = ir.node("Transpose", [x], attributes={"perm": [0, 2, 1, 3]})
        flat = ir.node("Reshape", [to.outputs[0], _constant(graph, f"flat_{count}x{head_dim}",
                                                               [0, 0, count * head_dim])])
        new_nodes.extend([to, flat])
        return flat.outputs[0]

    attention = ir.node(
        "GroupQueryAttention",
        [rows_first(q, heads), rows_first(k_new, kv_heads), rows_first(v_new, kv_heads),
         k_cache, v_cache, seqlens_k, total, *tables],
        attributes={"num_heads": heads, "kv_num_heads": kv_heads, "do_rotary": int(bool(tables)),
                    "scale": node.attributes["scale"].value},
        domain=CONTRIB, num_outputs=3, name=f"{node.name}_gqa")
    heads_out = ir.node("Reshape", [attention.outputs[0], _constant(
        graph, f"heads_{heads}x{head_dim}", [0, 0, heads, head_dim])])
    out = ir.node("Transpose", [heads_out.outputs[0]], attributes={"perm": [0, 2, 1, 3]})
    new_nodes += [attention, heads_out, out]
    ir.convenience.replace_nodes_and_values(
        graph, node, [node], new_nodes, list(node.outputs),
        [out.outputs[0], attention.outputs[1], attention.outputs[2]])
    return True


def _to_attention_over_seen_rows(graph, node) -> bool:
    """A non-causal node (the draft's block) as an ``Attention`` over the cache rows before
    ``start`` and the new rows beside them, every row seeing all of these. The new rows are not
    written into the cache (rows from ``start`` on are scratch), so the cache passes through
    unchanged, and the ``CacheWrite`` that made it writes straight into the bound buffer, in
    place, where the body copied the whole cache twice per layer (the demo draft: 4 of its 8
    ``ScatterElements`` copies, and a copy of every cache at release capacity). A cache that is a
    graph input would need a copy to pass through and keeps the body."""
    import onnx_ir as ir

    q, k_new, v_new, k_cache, v_cache, start = node.inputs
    if k_cache.producer() is None or v_cache.producer() is None:
        return False
    first, axis = _constant(graph, "zero", [0]), _constant(graph, "axis_rows", [2])

    def seen(cache, new):   # [1, H_kv, start + S, D]: the cache rows before start, then the new
        before = ir.node("Slice", [cache, first, start, axis])
        joined = ir.node("Concat", [before.outputs[0], new], attributes={"axis": 2})
        new_nodes.extend([before, joined])
        return joined.outputs[0]

    new_nodes = []
    attention = ir.node("Attention", [q, seen(k_cache, k_new), seen(v_cache, v_new)],
                        attributes={"scale": node.attributes["scale"].value}, name=f"{node.name}_seen")
    new_nodes.append(attention)
    ir.convenience.replace_nodes_and_values(graph, node, [node], new_nodes, list(node.outputs),
                                            [attention.outputs[0], k_cache, v_cache])
    return True


def rotary_tables(inv_freq, scaling: float, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """GroupQueryAttention's cos and sin caches ``[capacity, head_dim / 2]`` for a decoder's
    rotate-half RoPE, computed as ``modeling.decoder.Rotary`` computes them (float32)."""
    import torch

    freqs = torch.arange(capacity, dtype=torch.float32)[:, None] * torch.tensor(inv_freq, dtype=torch.float32)
    return (freqs.cos() * scaling).numpy(), (freqs.sin() * scaling).numpy()


def target_rotary(target: dict, capacity: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The rotary tables a target's causal nodes take (``rotary_tables`` of the manifest's
    ``target`` entry), or None where some of its layers rotate otherwise than the decoder says (a
    config part with a ``*rope_inv_freq`` of its own, as Gemma 4's full layers have): their nodes
    then keep their own rotations."""
    if any(key.endswith("rope_inv_freq") for name, part in target.items()
           if name != "decoder" and isinstance(part, dict) for key in part):
        return None
    decoder = target["decoder"]
    return rotary_tables(decoder["rope_inv_freq"], decoder["rope_attention_scaling"], capacity)


def _sequence_lengths(graph, q, start, new_nodes: list) -> tuple:
    """GroupQueryAttention's ``seqlens_k`` (``start + rows - 1`` per sequence, int32) and
    ``total_sequence_length`` (their largest plus one, an int32 scalar)."""
    import onnx_ir as ir

    rows = ir.node("Shape", [q], attributes={"start": 2, "end": 3})
    rows32 = ir.node("Cast", [rows.outputs[0]], attributes={"to": ir.DataType.INT32})
    start32 = ir.node("Cast", [start], attributes={"to": ir.DataType.INT32})
    end = ir.node("Add", [start32.outputs[0], rows32.outputs[0]])
    seqlens_k = ir.node("Sub", [end.outputs[0], _constant(graph, "one_int32", [1], np.int32)])
    total = ir.node("ReduceMax", [end.outputs[0]], attributes={"keepdims": 0})
    new_nodes += [rows, rows32, start32, end, seqlens_k, total]
    return seqlens_k.outputs[0], total.outputs[0]


def _rotated(value, head_dim: int) -> bool:
    """Whether ``value`` comes from a rotate-half ``RotaryEmbedding`` over whole ``[B, H, S, D]``
    heads at the positions its cos / sin inputs give (no ``position_ids``)."""
    node = value.producer()
    return (node is not None and node.op_type == "RotaryEmbedding" and node.domain == ""
            and len(node.inputs) == 3 and not node.attributes.get_int("interleaved", 0)
            and node.attributes.get_int("rotary_embedding_dim", 0) in (0, head_dim)
            and node.inputs[0].shape is not None and len(node.inputs[0].shape) == 4)


def _constant(graph, name: str, values, dtype=np.int64):
    """An initializer of ``graph`` (``dtype`` None: ``values`` is the array), made once."""
    import onnx_ir as ir

    name = f"gqa_{name}"
    if name not in graph.initializers:
        array = values if dtype is None else np.array(values, dtype)
        graph.register_initializer(ir.Value(name=name, const_value=ir.tensor(array)))
    return graph.initializers[name]


def _static(value, axis: int) -> bool:
    return value.shape is not None and isinstance(value.shape[axis], int)


def _symbolic(value, axis: int) -> bool:
    """A named dimension: nodes whose inputs share it have equal sizes there."""
    return value.shape is not None and getattr(value.shape[axis], "value", None) is not None
