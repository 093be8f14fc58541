"""Speculative tokens/s at several confidence thresholds and target-only tokens/s, on one engine,
interleaved prompt by prompt in one process (so that a slow spell of a shared machine falls on all
of them alike); greedy, batch 1, drafts verified as ``--draft-schedule`` says (adaptive by default).

    python scripts/threshold_sweep.py --engine engines/demo --thresholds 0.3 0.45 0.6 0.75 0
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.prompts import read_jsonl_prompts  # noqa: E402
from runtime.decoding.generator import Generator  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--thresholds", type=float, nargs="+", required=True)
    p.add_argument("--prompts-file", type=Path, default=Path("data/prompts/gsm8k.jsonl"))
    p.add_argument("--skip", type=int, default=180)
    p.add_argument("--limit", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--draft-schedule", default="adaptive", metavar="adaptive|N",
                   help="drafts verified per step, as python -m bench takes it [adaptive]")
    args = p.parse_args()
    prompts = read_jsonl_prompts(args.prompts_file, "--prompts-file")[args.skip:args.skip + args.limit]
    generator = Generator.from_engine(args.engine, threads=args.threads)
    generator.generate(prompts[0], max_new_tokens=4)   # warm-up, untimed
    schedule = generator.draft_schedule(args.draft_schedule)
    modes = {f"speculative, threshold {t:g}": {"confidence_threshold": t, "draft_schedule": schedule}
             for t in args.thresholds}
    modes["target-only"] = {"speculative": False}
    tokens, seconds = dict.fromkeys(modes, 0), dict.fromkeys(modes, 0.0)
    for prompt in prompts:
        for mode, options in modes.items():
            result = generator.generate(prompt, max_new_tokens=args.max_new_tokens, **options)
            tokens[mode] += len(result.token_ids[0])
            seconds[mode] += result.times.total
    baseline = tokens["target-only"] / seconds["target-only"]
    for mode in modes:
        rate = tokens[mode] / seconds[mode]
        print(f"{mode:32s} {rate:6.1f} tokens/s  {rate / baseline:.2f}x target-only")


if __name__ == "__main__":
    main()
