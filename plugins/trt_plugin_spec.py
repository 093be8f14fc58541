"""What one ``dspark`` operator's TensorRT plugin is (``PluginSpec``), written in the operator's
own folder (``trt_plugin.py``), and the tensors its ``enqueue`` launches Triton kernels on: torch
CUDA tensors over TensorRT's buffers and workspace, on TensorRT's stream.
``tensorrt_plugin.py`` turns the specs into ``IPluginV3`` plugins."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class PluginSpec:
    name: str
    num_outputs: int
    fields: dict[str, str]                 # attribute -> "int" | "float" (what TensorRT passes on)
    output_types: Callable                 # (trt, input_types) -> output types
    output_shapes: Callable                # (trt, input DimsExprs, expr builder) -> output DimsExprs
    supports: Callable                     # (trt, pos, in_out descs, num_inputs) -> bool
    enqueue: Callable    # (trt, attrs, input_descs, output_descs, inputs, outputs, workspace, stream)
    aliases: dict[int, int] = field(default_factory=dict)   # output index -> the input it updates
    workspace: Callable | None = None      # (input DynamicPluginTensorDescs) -> scratch bytes enqueue needs


def device_tensors(trt, pointers, descs) -> list:
    """Torch CUDA tensors over TensorRT's buffers (no copy), for launching Triton kernels."""
    import torch

    # bf16 has no CUDA-array-interface type string: wrap as int16 and reinterpret
    kinds = {trt.DataType.FLOAT: ("<f4", None), trt.DataType.HALF: ("<f2", None),
             trt.DataType.BF16: ("<i2", torch.bfloat16), trt.DataType.INT64: ("<i8", None),
             trt.DataType.INT32: ("<i4", None), trt.DataType.INT8: ("|i1", None),
             trt.DataType.UINT8: ("|u1", None)}
    tensors = []
    for pointer, desc in zip(pointers, descs):
        typestr, view = kinds[desc.type]
        buffer = type("Buffer", (), {"__cuda_array_interface__": {
            "shape": tuple(desc.dims), "typestr": typestr, "data": (pointer, False), "version": 3}})
        tensor = torch.as_tensor(buffer(), device="cuda")
        tensors.append(tensor.view(view) if view is not None else tensor)
    return tensors


def workspace_floats(pointer: int, nbytes: int):
    """A flat fp32 torch CUDA tensor over TensorRT's workspace for this enqueue (no copy)."""
    import torch

    buffer = type("Buffer", (), {"__cuda_array_interface__": {
        "shape": (nbytes // 4,), "typestr": "<f4", "data": (pointer, False), "version": 3}})
    return torch.as_tensor(buffer(), device="cuda")


def on_stream(stream: int):
    """Context manager: make TensorRT's stream torch's current one, so Triton launches on it."""
    import torch

    return torch.cuda.stream(torch.cuda.ExternalStream(stream))
