"""The compiled CPU library: the kernels of ``plugins/qmatmul`` (quantized weight products) and
``plugins/block_attention/cpu_kernel.cpp`` (causal attention over a pool of cache slots) as
ONNX Runtime custom ops of the domain ``dspark.cpu`` (``ort_ops.cpp``), built for the machine
that runs them (``build.py``). Together they let one ONNX Runtime call run a step for a whole
batch of sequences with every row computed as it would be alone (``runtime/backends/ort.py``).
"""
