"""ONNX Runtime CPU sessions of an engine's graphs in their fastest form: the graph as the engine
holds it (portable ONNX that every runtime reads), rewritten when it is loaded for ONNX Runtime's
CPU kernels and ours:

- the attention at batch 1 as ONNX Runtime's own kernels (``block_attention/ort_contrib.py``), or,
  for a batch of sequences in one call, as the compiled kernel over a pool of cache slots
  (``block_attention/ort_cpu.py``);
- the linear layers as the compiled kernels (``qmatmul/``), and a quantized MoE layer's experts
  on the same kernel (``moe/ort_cpu.py``), where they are built for this machine; elsewhere they
  stay ``DequantizeLinear -> MatMul`` (which ONNX Runtime fuses into its ``MatMulNBits``),
  ``MatMul``, or the experts' ONNX function.

A graph loaded from memory has its weights looked up in a folder, and ONNX Runtime maps them from
their files there: pages of the file, which the system reclaims under pressure. It refuses a
weights file that is a symbolic link out of that folder (a Hugging Face cache's snapshot), so
the folder given is the one the files really are in. The kernels' repacked weights are given to
it as arrays it uses in place (``SessionOptions.add_initializer``): its other ways in, weights
files in memory and ``add_external_initializers``, copy them (measured on ONNX Runtime 1.32:
twice the packed bytes while loading). A repacked weight's proto still names a file, which ONNX
Runtime checks exists: the graph's own weights file. Its optimizers never read those weights,
which only the kernels' ops take. So a graph costs its packed weights in memory, plus the
mapped pages of the weights it reads as they are (embeddings, norms).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .block_attention import ort_contrib, ort_cpu
from .d2t_gather import ort_cpu as markov
from .moe import ort_cpu as moe
from .qmatmul import ort_lowering as qmatmul


def lowered_session(path: Path, options, rotary: tuple[np.ndarray, np.ndarray] | None = None,
                    kernel: Path | None = None, batched: bool = False):
    """A session of the graph at ``path`` with its attention lowered (``rotary``: the decoder's
    tables, ``ort_contrib.rotary_tables``), its fp16 tables kept in fp16 (``_fp16_tables``) and,
    with ``kernel`` (``plugins.cpu.build.library()``), its linear layers and MoE experts on the
    compiled kernels and, with ``batched`` too, its attention over a pool of slots where the graph
    allows it (the session then has a ``slots`` input); None when there is nothing to lower.
    ``options`` are this session's alone."""
    import onnx_ir as ir
    import onnxruntime as ort

    model = ir.load(path)
    folder, anchor = _weights_folder(model, path)
    # the sampler first: its float product by markov_w2 is its own, not an FMatMul
    packed = markov.lower(model, anchor) | qmatmul.lower(model, anchor) | moe.lower(model, anchor) \
        if kernel is not None else {}
    tables = _fp16_tables(model)
    # a batch in one call only where every product is the kernel's (ONNX Runtime's float MatMul
    # gives a row other bits beside other rows)
    pooled = kernel is not None and batched and not qmatmul.float_products(model) and ort_cpu.lower(model)
    lowered = pooled or ort_contrib.lower(model, rotary)
    if not lowered and not packed and not tables:
        return None
    if pooled or packed:
        options.register_custom_ops_library(str(kernel))
    proto = ir.to_proto(model).SerializeToString()
    del model
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    # ONNX Runtime uses these arrays in place: they must live as long as the session
    weights = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in packed.items()}
    for name, value in weights.items():
        options.add_initializer(name, value)
    session = ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"])
    session.packed_weights = weights
    return session


def _fp16_tables(model) -> int:
    """Keep each fp16 table that a ``Gather`` reads (an embedding) in fp16: follow the ``Gather``
    with a ``Cast`` to float32 and back. ONNX Runtime has no fp16 kernels for most CPU ops, so it
    runs them in float32; a ``Gather`` of computed indices whose every reader is such an op it runs
    in float32 too, and then casts the whole table, once, into a float32 copy (the draft's
    embeddings of Gemma 4: 4 GB beside the 2 GB table). Its cast removal leaves one ``Cast`` of the
    gathered rows. Returns how many there were."""
    import onnx_ir as ir

    count = 0
    for node in list(model.graph):
        table = node.inputs[0] if node.op_type in ("Gather", "GatherND") and node.inputs else None
        if (node.domain not in ("", "ai.onnx") or table is None or not table.is_initializer()
                or table.dtype != ir.DataType.FLOAT16):
            continue
        rows = node.outputs[0]
        if rows.is_graph_output():
            continue
        wide = ir.node("Cast", [None], attributes={"to": ir.DataType.FLOAT}, name=f"{node.name}_wide")
        narrow = ir.node("Cast", wide.outputs, attributes={"to": ir.DataType.FLOAT16},
                         name=f"{node.name}_narrow")
        narrow.outputs[0].type, narrow.outputs[0].shape = rows.type, rows.shape
        rows.replace_all_uses_with(narrow.outputs[0])
        wide.replace_input_with(0, rows)
        model.graph.insert_after(node, [wide, narrow])
        count += 1
    return count


def _weights_folder(model, path: Path) -> tuple[Path, str]:
    """The folder ``model``'s weights files really are in (through any symbolic link, which
    ``onnx_ir`` and ONNX Runtime refuse to follow out of the graph's folder), each weight pointed
    at its file there, and the name of a file in it (for the repacked weights' protos)."""
    import onnx_ir as ir

    folders = set()
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor):
            real = Path(tensor.path).resolve()
            value.const_value = ir.ExternalTensor(real.name, tensor.offset, tensor.length, tensor.dtype,
                                                  shape=tensor.shape, name=tensor.name, base_dir=real.parent)
            folders.add(real)
    if not folders:
        return path.resolve().parent, path.resolve().name
    if len({file.parent for file in folders}) > 1:
        raise ValueError(f"{path}: its weights files are in several folders "
                         f"({', '.join(sorted(str(f) for f in folders))}); expected one")
    first = min(folders)
    return first.parent, first.name
