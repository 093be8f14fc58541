"""ONNX Runtime CPU sessions of an engine's graphs in their fastest form: the graph as the engine
holds it (portable ONNX that every runtime reads), rewritten when it is loaded for ONNX Runtime's
CPU kernels and ours:

- the attention at batch 1 as ONNX Runtime's own kernels (``block_attention/ort_contrib.py``), or,
  for a batch of sequences in one call, as the compiled kernel over a pool of cache slots
  (``block_attention/ort_cpu.py``);
- the quantized linear layers as the compiled kernel (``qmatmul/``), where it is built for this
  machine; elsewhere they stay ``DequantizeLinear -> MatMul``, which ONNX Runtime fuses into its
  ``MatMulNBits``.

A graph loaded from memory has its weights looked up in a folder, which ONNX Runtime maps as it
maps them beside a graph file, but it refuses a weights file that is a symbolic link out of that
folder (a Hugging Face cache's snapshot): such files are given to it mapped, and it copies them
while it loads (measured on the demo target: 0.9 GB peak instead of 0.5). The kernel's repacked
weights are handed over as arrays (``add_external_initializers``), so that a graph of any size
stays under protobuf's 2 GB.
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
    its quantized layers on the compiled kernel and, with ``batched`` too, its attention over a
    pool of slots where the graph allows it (the session then has a ``slots`` input); None when
    there is nothing to lower. ``options`` are this session's alone."""
    import mmap

    import onnx_ir as ir
    import onnxruntime as ort

    model = ir.load(path)
    packed = qmatmul.lower(model) if kernel is not None else {}
    # a batch in one call only where every product is the kernel's (ONNX Runtime's float MatMul
    # gives a row other bits beside other rows)
    pooled = kernel is not None and batched and not qmatmul.float_products(model) and ort_cpu.lower(model)
    lowered = pooled or ort_contrib.lower(model, rotary)
    if not lowered and not packed:
        return None
    if pooled or packed:
        options.register_custom_ops_library(str(kernel))
    if packed:
        options.add_external_initializers(list(packed),
                                          [ort.OrtValue.ortvalue_from_numpy(a) for a in packed.values()])
    files = sorted({value.const_value.location for value in model.graph.initializers.values()
                    if isinstance(value.const_value, ir.ExternalTensor) and value.name not in packed})
    proto = ir.to_proto(model).SerializeToString()
    del model
    if not any((path.parent / name).is_symlink() for name in files):
        options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                         str(path.parent))
        return ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"])
    maps = []
    try:
        for name in files:
            with open(path.parent / name, "rb") as f:
                maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        options.add_external_initializers_from_files_in_memory(files, maps, [len(m) for m in maps])
        return ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"])
    finally:   # ONNX Runtime has copied what it needs
        for mapped in maps:
            mapped.close()
