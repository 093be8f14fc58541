#!/usr/bin/env bash
# The target step's time by rows on release-shaped slices, hybrid beside dense (issue 26's benchmark):
# the first 4 layers of Qwen3.6-27B (3 gated-DeltaNet + 1 full attention) and of Qwen3-32B (the dense
# Qwen3 of the same width, 5120), vocabularies cut to 32768 ids so that the fp32 builds fit this
# machine's 24 GB, each as fp32 and int4 engines, timed interleaved by scripts/row_cost.py.
#   bash scripts/hybrid_rows.sh [OUT]     (OUT defaults to /tmp/hybrid-rows; about an hour on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/hybrid-rows}
PY=.venv/bin/python
mkdir -p "$OUT"
for preset in qwen3.6-27b qwen3-32b; do
  for weights in float int4; do
    engine="$OUT/engine-$preset-$weights"
    [ -f "$engine/manifest.json" ] && continue
    [ -d "$OUT/$preset" ] || $PY -c "
from pathlib import Path; from modeling.fixtures.presets import make_preset
make_preset(Path('$OUT/$preset'), '$preset', layers=4, vocab=32768)"
    # the draft quantized too at int4: it does not enter the target step's time, only the disk
    $PY -m export build --target "$OUT/$preset/target" --draft "$OUT/$preset/draft" --out "$engine" \
      --weights $weights $([ $weights = int4 ] && echo --quantize-draft) --max-batch 1 --max-seq-len 256 \
      --max-prompt-chunk 128 --quiet
  done
done
$PY scripts/row_cost.py --rows 1 2 5 8 9 --rounds 10 --engine \
  "$OUT/engine-qwen3.6-27b-float" "$OUT/engine-qwen3-32b-float" \
  "$OUT/engine-qwen3.6-27b-int4" "$OUT/engine-qwen3-32b-int4"
