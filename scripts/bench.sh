#!/usr/bin/env bash
# docs/measurements.md's "The demo pair" numbers: the demo pair (SmolLM2-135M-Instruct + its distilled DSpark draft)
# on prompts that distillation held out (the last 20 records of each file), batch 1, greedy and
# temperature 1, against target-only decoding on the same engine and transformers generate (plain
# and with prompt lookup). Writes docs/bench/<set>-t<T>.{json,png}. Extra arguments go to every
# `python -m bench` call (e.g. --limit 2 for a quick look).
set -euo pipefail
cd "$(dirname "$0")/.."
# its own engine folder: the demo's engines/smollm2-135m-instruct (built by scripts/demo.sh) is
# never replaced; built once, reused while it is there
ENGINE=${ENGINE:-engines/bench-smollm2-135m-instruct-float}
PROMPTS=data/prompts
# the demo pair (k = 4, confidence 0.6) with fp32 weights, as docs/measurements.md's "The demo
# pair" table was measured (the demo's default is the GGUF's own blocks: the "with quantized
# weights" table, and README's "Where it stands")
[ -f "$ENGINE/manifest.json" ] || .venv/bin/python -m export build --out "$ENGINE" --weights float
mkdir -p docs/bench
for temperature in 0 1; do
    for set in "gsm8k 180" "mt-bench 60" "humaneval 144"; do
        read -r name skip <<< "$set"
        .venv/bin/python -m bench --engine "$ENGINE" --prompts-file "$PROMPTS/$name.jsonl" \
            --skip "$skip" --limit 6 --max-new-tokens 128 --temperature "$temperature" \
            --prompt-lookup 4 --force --out "docs/bench/$name-t$temperature.json" \
            --plot "docs/bench/$name-t$temperature.png" "$@"
    done
done
