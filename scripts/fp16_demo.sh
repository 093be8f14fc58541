#!/usr/bin/env bash
# fp16 builds of the demo pair in each weight format, each verified by `build` against PyTorch,
# then their teacher-forced agreement with the fp32 engine of the same weights (docs/measurements.md,
# "fp16 builds of the demo pair"). About 20 minutes on 2 cores. Engines go to engines/fp16-demo-*.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f engines/fp16-demo-fp32/manifest.json ] || .venv/bin/python -m export build --out engines/fp16-demo-fp32 --weights float --quiet
for weights in float int8 int4; do
    [ -f "engines/fp16-demo-$weights/manifest.json" ] || \
        .venv/bin/python -m export build --out "engines/fp16-demo-$weights" --dtype fp16 --weights "$weights" --quiet
done
.venv/bin/python scripts/engine_quality.py --reference engines/fp16-demo-fp32 \
    engines/fp16-demo-float engines/fp16-demo-int8 engines/fp16-demo-int4 "$@"
