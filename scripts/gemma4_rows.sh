#!/usr/bin/env bash
# The target step's time by rows on release-shaped slices, Gemma 4 beside dense Qwen3 (issue 27's
# benchmark): the first 6 layers of gemma-4-12B (5 sliding, window 1024 + 1 full attention of head 512,
# K = V) and 6 layers of a Qwen3 of the same width (hidden 3840: 30 heads of 128, 6 KV heads, MLP 15360,
# as wide as Gemma's), vocabularies cut to 32768 ids so that the fp32 builds fit this machine's 24 GB,
# timed interleaved by scripts/row_cost.py at 1 and k + 1 = 8 rows behind 1536 cached rows (past the
# window, so that Gemma's sliding layers read 1024 rows where Qwen3's read them all).
#   bash scripts/gemma4_rows.sh [OUT]     (OUT defaults to /tmp/gemma4-rows; about half an hour on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/gemma4-rows}
PY=.venv/bin/python
mkdir -p "$OUT"
for preset in gemma4-12b qwen3-3840; do
  engine="$OUT/engine-$preset"
  [ -f "$engine/manifest.json" ] && continue
  [ -d "$OUT/$preset" ] || $PY -c "
from pathlib import Path
from export import presets
presets.PRESETS['qwen3-3840'] = presets.Preset(3840, 6, 30, 15360, tie_word_embeddings=True, num_key_value_heads=6)
presets.make_preset(Path('$OUT/$preset'), '$preset', layers=6, vocab=32768)"
  $PY -m export build --target "$OUT/$preset/target" --draft "$OUT/$preset/draft" --out "$engine" \
    --max-batch 1 --max-seq-len 2048 --max-prompt-chunk 128 --quiet
done
$PY scripts/row_cost.py --rows 1 8 --context 1536 --rounds 10 --engine "$OUT/engine-gemma4-12b" \
  "$OUT/engine-qwen3-3840"
