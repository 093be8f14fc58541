#!/usr/bin/env bash
# Set up and run the test suite (CPU; GPU tests are skipped without a GPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# Triton Inference Server for tests/serving/test_triton.py (which skips without it)
bash scripts/setup_triton.sh
# lint first: a second, and a red CI names the line
.venv/bin/ruff check .
# one worker per core, each test file on one worker (its module fixtures built once); the slowest
# tests' times in the log: what to look at when the suite nears CI's time budget
.venv/bin/python -m pytest -q -n auto --dist loadfile --durations=25 "$@"
