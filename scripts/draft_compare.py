"""Drafts against each other on their held-out prompts: engines of one target with different
drafts, speculative (each at its own k and threshold) and the target alone, interleaved prompt by
prompt in one process (a slow spell of a shared machine falls on all of them alike); acceptance
(tau) and tokens/s per prompt set, with each engine's speculative / target-only ratio. Checks that
every greedy output is the target's own.

    python scripts/draft_compare.py --engine engines/old engines/new --temperature 0 1 \\
        --sets gsm8k:180 mt-bench:60 humaneval:144 math500:180 --limit 6
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.prompts import read_jsonl_prompts  # noqa: E402
from runtime.decoding.generator import Generator  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", nargs="+", required=True, help="engines of one target, other drafts")
    p.add_argument("--sets", nargs="+", default=["gsm8k:180", "mt-bench:60", "humaneval:144"],
                   help="NAME:SKIP: data/prompts/NAME.jsonl from record SKIP (the held-out ones)")
    p.add_argument("--limit", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="the table as JSON")
    args = p.parse_args()
    generators = {engine: Generator.from_engine(engine, threads=args.threads) for engine in args.engine}
    first = generators[args.engine[0]]
    rows = []
    for name, skip in (entry.split(":") for entry in args.sets):
        path = ROOT / "data" / "prompts" / f"{name}.jsonl"
        prompts = read_jsonl_prompts(path, "--sets")[int(skip):int(skip) + args.limit]
        for temperature in args.temperature:
            speeds = {mode: [] for mode in ("target", *args.engine)}
            taus = {engine: [] for engine in args.engine}
            for index, prompt in enumerate(prompts):
                options = dict(max_new_tokens=args.max_new_tokens, temperature=temperature, seed=index)
                alone = first.generate([prompt], speculative=False, **options)
                speeds["target"].append(alone.tokens_per_second)
                for engine, generator in generators.items():
                    out = generator.generate([prompt], **options)
                    if temperature == 0 and out.token_ids != alone.token_ids:
                        sys.exit(f"{engine}: greedy output differs from the target's on {name} record "
                                 f"{int(skip) + index}")
                    speeds[engine].append(out.tokens_per_second)
                    taus[engine].append(out.stats.tau)
            target = statistics.median(speeds["target"])
            for engine in args.engine:
                spec = statistics.median(speeds[engine])
                rows.append({"set": name, "temperature": temperature, "engine": engine,
                             "tau": statistics.mean(t for t in taus[engine] if t is not None),
                             "speculative": spec, "target": target,
                             "ratio": spec / target})
                print(f"{name:10s} T={temperature:g} {engine:40s} tau {rows[-1]['tau']:.2f}  "
                      f"{spec:6.1f} tok/s  target {target:6.1f}  {spec / target:.2f}x", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
