#!/usr/bin/env bash
# Quick start: set up, make the built-in tiny target + DSpark draft pair, export it to an engine
# directory (ONNX, verified against PyTorch in ONNX Runtime), and run speculative decoding on it.
# Random weights: the text is noise; the point is the pipeline. Extra arguments go to
# `python -m runtime.generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m export make-tiny engines/tiny-checkpoints --force
.venv/bin/python -m export build --target engines/tiny-checkpoints/target \
    --draft engines/tiny-checkpoints/draft --out engines/tiny --max-seq-len 256 --force
.venv/bin/python -m export inspect engines/tiny
.venv/bin/python -m runtime.generate --engine engines/tiny --prompt "Once upon a time" \
    --max-new-tokens 48 --stats "$@"
