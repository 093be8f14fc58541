"""``dspark.cpu::QMatMul``: the CPU kernel for the engines' block-quantized weight products
(a GGUF file's blocks, int4 / int8 RTN), compiled for the machine that runs it.

``kernel.cpp`` computes (what llama.cpp's CPU kernels do: int8 activations per block, integer
dot products, each weight block read once for every row of a call, and each output row in a
fixed order of its own, so a sequence's result is the same alone and in any batch);
``layout.py`` repacks a weight for it and says in numpy what it computes; ``ort_lowering.py``
rewrites an engine graph's quantized layers into it when the graph is loaded. Its ONNX Runtime
op and build are ``plugins/cpu``'s.
"""
