"""``python -m runtime.generate``: speculative decoding from the command line.

Until engine directories exist this runs the PyTorch reference backend straight from the target
and draft checkpoints.
"""
from __future__ import annotations

import argparse
import sys
import time

from export.checkpoint import CheckpointError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.generate",
                                description="Generate with DSpark speculative decoding (PyTorch "
                                            "reference backend, CPU).")
    p.add_argument("--target", required=True, help="target checkpoint: directory or hub id")
    p.add_argument("--draft", help="DSpark draft checkpoint: directory or hub id "
                                   "(omit for target-only decoding)")
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeat for a batch)")
    p.add_argument("--k", type=int, default=None, help="drafts per step [the draft's trained number]")
    p.add_argument("--max-new-tokens", type=int, default=64, help="[64]")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy [0]")
    p.add_argument("--top-p", type=float, default=1.0, help="[1.0]")
    p.add_argument("--seed", type=int, default=0, help="[0]")
    p.add_argument("--no-chat-template", action="store_true",
                   help="tokenize prompts as they are instead of through the chat template")
    p.add_argument("--no-spec", action="store_true", help="target-only decoding (the baseline)")
    p.add_argument("--stats", action="store_true", help="print tau and per-position acceptance")
    return p


def _encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and tokenizer.chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return tokenizer.encode(prompt, add_special_tokens=False)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    from transformers import AutoTokenizer

    from export.checkpoint import resolve
    from export.pair import load_pair

    from .speculative import generate
    from .torch_backend import TorchBackend

    try:
        target_dir = resolve(args.target, "target")
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        target, draft = load_pair(target_dir, None if args.no_spec else args.draft, k=args.k)
        prompts = [_encode(tokenizer, p, not args.no_chat_template) for p in args.prompt]
        lookahead = draft.config.block_size + 1 if draft else 1
        capacity = max(map(len, prompts)) + args.max_new_tokens + lookahead
        started = time.perf_counter()
        result = generate(TorchBackend(target, draft, capacity), prompts,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, seed=args.seed,
                          eos_token_ids=target.config.eos_token_ids)
        elapsed = time.perf_counter() - started
    except (CheckpointError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None

    for prompt, ids in zip(args.prompt, result.token_ids):
        print(f"### {prompt}\n{tokenizer.decode(ids, skip_special_tokens=True)}\n")
    if args.stats:
        tokens = sum(map(len, result.token_ids))
        s = result.stats
        print(f"tokens {tokens} in {elapsed:.2f}s ({tokens / elapsed:.1f} tok/s); verify steps "
              f"{s.steps}; tau {s.tau:.2f}; acceptance per position "
              f"{[round(a, 3) for a in s.acceptance_per_position]}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
