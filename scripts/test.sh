#!/usr/bin/env bash
# Set up and run the test suite (CPU; GPU tests are skipped without a GPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q "$@"
