#!/usr/bin/env bash
# GPU check (under 5 minutes on one GPU): Triton kernels on CUDA, the PyTorch backend with CUDA
# graphs against ONNX Runtime, and TensorRT engines where TensorRT is importable. Uses the
# project's .venv when there is one, else the machine's python3.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=python3
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
exec "$PYTHON" scripts/gpu_check.py
