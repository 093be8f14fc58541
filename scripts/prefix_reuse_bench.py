"""Time to first token of a chat's next turn after a long history, with the previous turn's caches
reused (``Generator.conversation(..., after=previous)``: only the new turn is prefilled) and
without (the whole conversation prefilled anew), interleaved in one process; the two answers must
be the same tokens.

    python scripts/prefix_reuse_bench.py --engine engines/smollm2-135m-instruct --history 1000 --repeat 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def history(generator, tokens: int) -> list[dict]:
    """A conversation of held-out mt-bench questions and made-up answers, at least ``tokens`` long."""
    records = [json.loads(line) for line in (ROOT / "data/prompts/mt-bench.jsonl").read_text().splitlines()]
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for record in records:
        messages += [{"role": "user", "content": record["turns"][0]},
                     {"role": "assistant", "content": record["turns"][-1]}]
        if len(generator.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)) >= tokens:
            return messages
    raise SystemExit(f"error: mt-bench has too few records for a {tokens}-token history")


def first_token(generator, messages: list[dict], after=None) -> tuple[float, object]:
    """Seconds from the turn's start to its first token, and the finished decoding."""
    decoding = generator.conversation(messages, after=after, max_new_tokens=16)
    begin, ttft = time.perf_counter(), None
    for _ in decoding:
        if ttft is None:
            ttft = time.perf_counter() - begin
    return ttft, decoding


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--history", type=int, default=1000, help="tokens of conversation before the turn [1000]")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int)
    args = p.parse_args()
    from runtime import Generator

    generator = Generator.from_engine(args.engine, threads=args.threads)
    messages = history(generator, args.history)
    turn = messages[:-1]          # the history up to its last question: the first turn to answer
    times = {"reused": [], "prefilled anew": []}
    for _ in range(args.repeat):
        _, previous = first_token(generator, turn[:-2])        # the turn before, whose caches are kept
        following = turn[:-2] + [{"role": "assistant", "content": generator.collect([previous]).texts[0]},
                                 turn[-1]]
        reused, kept = first_token(generator, following, after=previous)
        anew, fresh = first_token(generator, following)
        assert kept.result.token_ids == fresh.result.token_ids, "reuse changed the answer"
        times["reused"].append(reused)
        times["prefilled anew"].append(anew)
        cached = kept.requests[0].reused
    length = len(kept.requests[0].prompt)
    print(f"{args.engine}: next turn of a {length}-token conversation, {cached} of its tokens in the "
          f"kept caches; time to first token, median (range) of {args.repeat}:")
    for name, samples in times.items():
        print(f"  {name:15s} {statistics.median(samples) * 1000:7.1f} ms "
              f"({min(samples) * 1000:.1f}-{max(samples) * 1000:.1f})")
    ratio = statistics.median(times["reused"]) / statistics.median(times["prefilled anew"])
    print(f"  reused / anew   {ratio:.3f}")


if __name__ == "__main__":
    main()
