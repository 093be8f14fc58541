#!/usr/bin/env bash
# Create .venv-triton: the Triton Inference Server that nvidia-pytriton ships (the tritonserver
# binary, 2.51, and its Python backend) for `python -m export triton-repo`'s models. Its
# Python-backend stub is built against NumPy 1, so this environment keeps numpy<2 (nvidia-pytriton
# pins it) and reaches torch, ONNX Runtime and dspark-trt in .venv through a .pth file, listed
# after its own site-packages. Run scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "error: run scripts/setup.sh first (.venv is missing)" >&2; exit 1; }
# the stub links the interpreter's libpython: the same interpreter as .venv's
base=$(.venv/bin/python -c "import sys; print(sys.base_prefix)")
[ -x .venv-triton/bin/python ] || "$base/bin/python3" -m venv .venv-triton
.venv-triton/bin/python -m pip install -q "nvidia-pytriton==0.7.0"
main_site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
triton_site=$(.venv-triton/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import site; site.addsitedir('$main_site')" > "$triton_site/zz-dspark-trt.pth"
