#!/usr/bin/env bash
# Quick start: set up, export the built-in demo pair (SmolLM2-135M-Instruct and the DSpark draft
# distilled for it, export/drafts/smollm2-135m-instruct) to an engine directory, verified against
# PyTorch in ONNX Runtime, and run speculative decoding on it with statistics. Extra arguments go to
# `python -m runtime.generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m export build --out engines/smollm2-135m-instruct --force
.venv/bin/python -m export inspect engines/smollm2-135m-instruct
.venv/bin/python -m runtime.generate --engine engines/smollm2-135m-instruct \
    --prompt "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?" \
    --max-new-tokens 128 --stats "$@"
