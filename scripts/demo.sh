#!/usr/bin/env bash
# Quick start: set up, export the built-in demo pair (SmolLM2-135M-Instruct and the DSpark draft
# distilled for it, modeling/drafts/smollm2-135m-instruct) to an engine directory, verified against
# PyTorch in ONNX Runtime, and run speculative decoding on it with statistics, then target-only
# decoding for comparison. Extra arguments go to `python -m runtime.generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m export build --out engines/smollm2-135m-instruct --force
.venv/bin/python -m export inspect engines/smollm2-135m-instruct
# a question the demo's 135M model answers right: speculative, then the target alone on the same
# engine (the same text, token for token; compare the tokens/s)
PROMPT="Write a Python function that returns the square of a number."
for mode in "" --no-spec; do
    .venv/bin/python -m runtime.generate --engine engines/smollm2-135m-instruct --prompt "$PROMPT" \
        --max-new-tokens 128 --stats $mode "$@"
done
