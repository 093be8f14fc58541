"""``python -m runtime.generate``: speculative decoding over an engine directory."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from export.checkpoint import CheckpointError
from export.manifest import ManifestError
from export.prompts import read_jsonl_prompts

from .backends import BACKENDS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m runtime.generate",
        description="Generate with DSpark speculative decoding over an engine directory built by "
                    "`python -m export build`. Prompts come from --prompt, --prompts-file or "
                    "standard input (one prompt per line).")
    p.add_argument("--engine", required=True, help="engine directory")
    p.add_argument("--backend", choices=BACKENDS, default="ort",
                   help="ort: ONNX Runtime on the CPU; torch: the PyTorch reference [ort]")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads [all cores]")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", type=Path,
                   help="JSON Lines of {\"turns\": [...]}; the first turn of each is the prompt")
    p.add_argument("--skip", type=int, default=0, help="leave out the first N prompts [0]")
    p.add_argument("--limit", type=int, help="use only the first N prompts (after --skip)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="tokenize prompts as they are instead of through the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="[128]")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy [0]")
    p.add_argument("--top-p", type=float, default=1.0, help="[1.0]")
    p.add_argument("--seed", type=int, default=0, help="[0]")
    p.add_argument("--confidence-threshold", type=float, metavar="P",
                   help="verify drafts only up to the first whose top draft probability is below P; "
                        "0 verifies all k [the engine's, from build]")
    p.add_argument("--batch-size", type=int, help="prompts per batch [the engine's --max-batch]")
    p.add_argument("--no-spec", action="store_true",
                   help="target-only decoding on the same engine (the baseline)")
    p.add_argument("--stream", action="store_true",
                   help="print text as it is accepted (one prompt at a time)")
    p.add_argument("--stats", action="store_true",
                   help="print tau, per-position acceptance, tokens/s and time per phase")
    p.add_argument("--trace", type=Path,
                   help="write one JSON line per step and sequence (anchor, drafts, accepted, emitted)")
    return p


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += read_jsonl_prompts(args.prompts_file, "--prompts-file")
    if not prompts and not sys.stdin.isatty():
        prompts = [line for line in sys.stdin.read().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("no prompt: pass --prompt, --prompts-file or lines on standard input")
    if args.skip < 0 or args.skip >= len(prompts):
        raise ValueError(f"--skip {args.skip}: expected at least 0 and fewer than the {len(prompts)} "
                         f"prompts given")
    prompts = prompts[args.skip:]
    return prompts[: args.limit] if args.limit else prompts


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    from .generator import Generator

    try:
        prompts = read_prompts(args)
        generator = Generator.from_engine(args.engine, backend=args.backend, threads=args.threads)
        options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, seed=args.seed, speculative=not args.no_spec,
                       confidence_threshold=args.confidence_threshold,
                       chat_template=not args.no_chat_template,
                       batch_size=1 if args.stream else args.batch_size)
        if args.stream:
            run_streaming(generator, prompts, options, args)
        else:
            run_batched(generator, prompts, options, args)
    except (CheckpointError, ManifestError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None


def run_batched(generator, prompts: list[str], options: dict, args) -> None:
    """Generate batch by batch; Ctrl-C stops cleanly and prints what was generated so far."""
    decodings, interrupted = [], False
    try:
        for decoding in generator.decodings(prompts, **options):
            decodings.append(decoding)
            for _ in decoding:
                pass
    except KeyboardInterrupt:
        interrupted = True
    result = generator.collect(decodings)
    for prompt, text in zip(prompts, result.texts):
        print(f"### {prompt}\n{text}\n")
    _report(result, args)
    if interrupted:
        print(f"[interrupted after {len(result.texts)} of {len(prompts)} prompts started]",
              file=sys.stderr)
        raise SystemExit(130)


def run_streaming(generator, prompts: list[str], options: dict, args) -> None:
    """Stream each prompt in turn; Ctrl-C stops cleanly after printing what was generated."""
    try:
        for prompt in prompts:
            print(f"### {prompt}", flush=True)
            for piece in generator.stream(prompt, **options):
                print(piece, end="", flush=True)
            print("\n", flush=True)
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        raise SystemExit(130) from None


def _report(result, args) -> None:
    if args.trace:
        with args.trace.open("w") as f:
            for record in result.trace:
                f.write(json.dumps(record) + "\n")
    if args.stats:
        s, t = result.stats, result.times
        tokens = sum(map(len, result.token_ids))
        lines = [f"tokens {tokens} in {t.total:.3f}s: {result.tokens_per_second:.1f} tokens/s",
                 f"verify steps {s.steps}, tau {s.tau:.3f} tokens per step"]
        if s.k:
            per_position = " ".join(f"{a:.2f}" for a in s.acceptance_per_position)
            lines.append(f"acceptance per position: {per_position}")
        lines.append("time: " + ", ".join(
            f"{name} {getattr(t, name):.3f}s ({100 * getattr(t, name) / t.total:.0f}%)"
            for name in ("prefill", "draft", "verify", "host")))
        print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
