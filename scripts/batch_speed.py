"""Tokens/s of the same prompts run one per batch and in batches of ``--batch``, speculative and
target-only, interleaved and repeated in one process (docs/usage.md, "Batching on the CPU"); also
checks that every mode gives the prompts' batch-1 target-only text.

    python scripts/batch_speed.py --engine engines/smollm2-135m-instruct --batch 4
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from runtime import Generator

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompts-file", type=Path, default=ROOT / "data/prompts/gsm8k.jsonl")
    p.add_argument("--skip", type=int, default=180)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    lines = args.prompts_file.read_text().splitlines()[args.skip:args.skip + args.batch]
    prompts = [json.loads(line)["turns"][0] for line in lines]
    generator = Generator.from_engine(args.engine, threads=args.threads)
    modes = [(size, spec) for size in (1, args.batch) for spec in (True, False)]
    speeds, texts = {mode: [] for mode in modes}, {}
    for _ in range(args.repeat):
        for size, spec in modes:
            out = generator.generate(prompts, batch_size=size, speculative=spec,
                                     max_new_tokens=args.max_new_tokens)
            speeds[size, spec].append(sum(map(len, out.token_ids)) / out.times.total)
            texts[size, spec] = out.token_ids
    for (size, spec), runs in speeds.items():
        print(f"batch {size} {'speculative' if spec else 'target only':12} median "
              f"{statistics.median(runs):6.1f} tok/s [{min(runs):.1f}, {max(runs):.1f}]  "
              f"text == batch-1 target only: {texts[size, spec] == texts[1, False]}")


if __name__ == "__main__":
    main()
