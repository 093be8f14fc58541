#!/usr/bin/env bash
# The demo pair against llama.cpp's own tools on the same GGUF file (README, "Where it stands"): its
# target-only and its DSpark with our draft as its converter writes it, on held-out gsm8k and
# mt-bench (6 prompts x 128 tokens, greedy, batch 1, interleaved prompt by prompt), and
# runtime.serve against llama-server with as many slots as the engine (16 held-out gsm8k prompts,
# 96 tokens, 1 and 4 clients). Builds llama.cpp's tools for this CPU (cached; about 10 minutes the
# first time), the demo engine where it is missing, and the converted draft (cached). Writes
# docs/bench/llama-cpp/{gsm8k,mt-bench,serve}.{json,png} (OUT= to write elsewhere). Extra arguments
# go to every `python -m bench` call (e.g. --limit 2 for a quick look).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
$PY -m bench.llama_cpp_tools > /dev/null
ENGINE=${ENGINE:-engines/smollm2-135m-instruct}
[ -f "$ENGINE/manifest.json" ] || $PY -m export build --out "$ENGINE" --quiet
TARGET=$($PY -c 'from modeling import demo_pair; print(demo_pair.target())')
DRAFT=${XDG_CACHE_HOME:-$HOME/.cache}/dspark-trt/llama.cpp/smollm2-135m-instruct-dspark.gguf
[ -f "$DRAFT" ] || $PY -m bench.llama_cpp_tools draft modeling/drafts/smollm2-135m-instruct "$TARGET" "$DRAFT"
OUT=${OUT:-docs/bench/llama-cpp}
mkdir -p "$OUT"
for set in "gsm8k 180" "mt-bench 60"; do
    read -r name skip <<< "$set"
    $PY -m bench --engine "$ENGINE" --prompts-file "data/prompts/$name.jsonl" --skip "$skip" --limit 6 \
        --max-new-tokens 128 --no-transformers --threads 2 --llama-cpp "$TARGET" --llama-cpp-draft "$DRAFT" \
        --force --out "$OUT/$name.json" --plot "$OUT/$name.png" "$@"
done
$PY scripts/serve_bench.py --engine "$ENGINE" --skip 180 --limit 16 --max-tokens 96 --threads 2 \
    --clients 1,4 --repeat 2 --llama-cpp "$TARGET" --out "$OUT/serve.json" --plot "$OUT/serve.png"
