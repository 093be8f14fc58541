"""Modules -> graphs -> engines: ONNX export of the target and draft steps (``onnx_export``), weight
quantization (``quantize``, GGUF blocks in ``gguf_blocks``), TensorRT builds (``trt_build``), the
build that writes an engine directory (``build``) and its CLI, ``python -m export``."""
