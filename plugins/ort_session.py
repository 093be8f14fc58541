"""ONNX Runtime CPU sessions of an engine's graphs in their fastest form: the graph as the engine
holds it (portable ONNX that every runtime reads), rewritten when it is loaded for ONNX Runtime's
CPU kernels and ours:

- the attention at batch 1 as ONNX Runtime's own kernels (``block_attention/ort_contrib.py``), or,
  for a batch of sequences in one call, as the compiled kernel over a pool of cache slots
  (``block_attention/ort_cpu.py``);
- the linear layers as the compiled kernels (``qmatmul/``), where they are built for this
  machine; elsewhere they stay ``DequantizeLinear -> MatMul`` (which ONNX Runtime fuses into its
  ``MatMulNBits``) or ``MatMul``.

A graph loaded from memory has its weights looked up in a folder, which ONNX Runtime maps as it
maps them beside a graph file, but it refuses a weights file that is a symbolic link out of that
folder (a Hugging Face cache's snapshot): such files are given to it mapped, and it copies them
while it loads (measured on the demo target: 0.9 GB peak instead of 0.5). The kernels' repacked
weights are given to it as one more file in memory (``qmatmul.packed_file``), so that a graph of
any size stays under protobuf's 2 GB; ONNX Runtime then wants every file in memory, and copies
the graph's remaining weights too (on the demo target, its embeddings and norms).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .block_attention import ort_contrib, ort_cpu
from .qmatmul import ort_lowering as qmatmul


def lowered_session(path: Path, options, rotary: tuple[np.ndarray, np.ndarray] | None = None,
                    kernel: Path | None = None, batched: bool = False):
    """A session of the graph at ``path`` with its attention lowered (``rotary``: the decoder's
    tables, ``ort_contrib.rotary_tables``) and, with ``kernel`` (``plugins.cpu.build.library()``),
    its linear layers on the compiled kernels and, with ``batched`` too, its attention over a
    pool of slots where the graph allows it (the session then has a ``slots`` input); None when
    there is nothing to lower. ``options`` are this session's alone."""
    import mmap

    import onnx_ir as ir
    import onnxruntime as ort

    model = ir.load(path)
    linked = _resolve_links(model)
    packed = qmatmul.lower(model) if kernel is not None else {}
    # a batch in one call only where every product is the kernel's (ONNX Runtime's float MatMul
    # gives a row other bits beside other rows)
    pooled = kernel is not None and batched and not qmatmul.float_products(model) and ort_cpu.lower(model)
    lowered = pooled or ort_contrib.lower(model, rotary)
    if not lowered and not packed:
        return None
    if pooled or packed:
        options.register_custom_ops_library(str(kernel))
    stored = [value.const_value for value in model.graph.initializers.values()
              if isinstance(value.const_value, ir.ExternalTensor)]
    files = {tensor.location: tensor.path for tensor in stored if tensor.location != qmatmul.PACKED}
    proto = ir.to_proto(model).SerializeToString()
    del model
    in_memory = {qmatmul.PACKED: qmatmul.packed_file(packed)} if packed else {}
    maps = []
    try:
        # ONNX Runtime looks every file up in memory once one is given there
        if in_memory or linked:
            for location, file in files.items():
                with open(file, "rb") as f:
                    maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                in_memory[location] = maps[-1]
        else:
            options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                             str(path.parent))
        if in_memory:
            options.add_external_initializers_from_files_in_memory(
                list(in_memory), list(in_memory.values()), [len(data) for data in in_memory.values()])
        return ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"])
    finally:   # ONNX Runtime has copied what it needs
        for mapped in maps:
            mapped.close()


def _resolve_links(model) -> bool:
    """Point each weight kept in a file that is a symbolic link (a Hugging Face cache's snapshot)
    at the file it links to, which the lowerings may then read (``onnx_ir`` refuses to follow a
    link out of the graph's folder); whether there was one."""
    import onnx_ir as ir

    linked = False
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and Path(tensor.path).is_symlink():
            real = Path(tensor.path).resolve()
            value.const_value = ir.ExternalTensor(real.name, tensor.offset, tensor.length, tensor.dtype,
                                                  shape=tensor.shape, name=tensor.name, base_dir=real.parent)
            linked = True
    return linked
