"""``python -m runtime.generate``: speculative decoding over an engine directory.

Ctrl-C stops cleanly at any moment: while the command parses, imports torch and transformers and
loads the engine, it ends the process at once with one line (status 130), and during generation
it prints what was generated. So that this holds from the first moment, the module imports only
small standard modules at the top; the rest is imported where it is used, inside ``main``.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from runtime.backends import BACKENDS

# what each numeric flag of generate and bench accepts: checked before anything loads, so that no
# value is clamped, ignored or taken to mean "all"
EXPECTED = {
    "skip": (lambda v: v >= 0, "at least 0"),
    "limit": (lambda v: v >= 1, "at least 1"),
    "threads": (lambda v: v >= 1, "at least 1"),
    "batch_size": (lambda v: v >= 1, "at least 1"),
    "max_new_tokens": (lambda v: v >= 1, "at least 1"),
    "temperature": (lambda v: 0 <= v <= 2, "0 .. 2 (0 is greedy), as the server's"),
    "top_p": (lambda v: 0 < v <= 1, "more than 0 and at most 1"),
    "top_k": (lambda v: v >= 0, "at least 0 (0: every token)"),
    "repetition_penalty": (lambda v: 0 < v < math.inf, "a finite number above 0 (1: off)"),
    "confidence_threshold": (lambda v: 0 <= v <= 1, "0 (verify every draft) .. 1"),
    "prompt_lookup": (lambda v: v >= 0, "at least 0 (0: off)"),
}


def parser():
    from common.cli_parser import Parser

    p = Parser(
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
    p.add_argument("--all-turns", action="store_true",
                   help="with --prompts-file: each record's turns as one conversation, every answer "
                        "part of the next turn's prompt, a record at a time [its first turn]")
    p.add_argument("--skip", type=int, default=0, help="leave out the first N prompts [0]")
    p.add_argument("--limit", type=int, help="use only the first N prompts (after --skip)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="tokenize prompts as they are instead of through the chat template")
    p.add_argument("--system", metavar="TEXT", help="a system message before each prompt (chat template)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a sequence at this text, which is not printed (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="[128]")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy [0]")
    p.add_argument("--top-p", type=float, default=1.0, help="[1.0]")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample from the K most likely tokens only, before --top-p; 0: all [0]")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="P",
                   help="divide the logits of tokens already in the sequence (prompt included) by P, "
                        "as transformers' repetition_penalty; 1: off [1.0]")
    p.add_argument("--seed", type=int, default=0, help="[0]")
    p.add_argument("--confidence-threshold", type=float, metavar="P",
                   help="verify drafts only up to the first whose top draft probability is below P; "
                        "0 verifies all k [the engine's, from build]")
    add_draft_schedule(p)
    p.add_argument("--batch-size", type=int,
                   help="prompts per batch [1 on the ort backend, where batching is measured no "
                        "faster; the engine's --max-batch on the others]")
    p.add_argument("--no-spec", action="store_true",
                   help="target-only decoding on the same engine (the baseline)")
    p.add_argument("--stream", action="store_true",
                   help="print text as it is accepted (one prompt at a time)")
    p.add_argument("--stats", action="store_true",
                   help="print tau, per-position acceptance, tokens/s and time per phase")
    p.add_argument("--trace", type=Path,
                   help="write one JSON line per step and sequence (anchor, drafts, accepted, emitted)")
    return p


def add_draft_schedule(p) -> None:
    p.add_argument("--draft-schedule", default="adaptive", metavar="adaptive|N",
                   help="drafts verified per step: adaptive (as many as this sequence's own "
                        "acceptance and the call costs measured at start make pay, none where "
                        "drafts are not being accepted), or at most N every step [adaptive]")


def fixed_schedule(args, generator):
    """The fixed ``LoadSchedule`` that --draft-schedule names, or None for "adaptive", which the
    ``Generator`` measures once the prompts are checked (and not at all without speculation)."""
    from runtime.decoding.draft_schedule import LoadSchedule

    return LoadSchedule.parse(args.draft_schedule, generator.backend.limits.k)


def check_flags(args) -> None:
    """Refuse the first numeric flag out of range (``EXPECTED``), naming it."""
    for name, (ok, expected) in EXPECTED.items():
        value = getattr(args, name, None)
        if value is not None and not ok(value):
            raise ValueError(f"--{name.replace('_', '-')} {value}: expected {expected}")


def read_prompts(args) -> list:
    """The --prompt values and --prompts-file records, or, when neither was given, the lines of
    standard input; then --skip and --limit. With --all-turns, each record's list of turns."""
    from common.prompts import read_jsonl_conversations, read_jsonl_prompts, utf8_text

    prompts = list(args.prompt)
    if getattr(args, "all_turns", False):
        if not args.prompts_file or args.prompt:
            raise ValueError("--all-turns: needs --prompts-file (and no --prompt): its records' turns")
        prompts = read_jsonl_conversations(args.prompts_file, "--prompts-file")
    elif args.prompts_file:
        prompts += read_jsonl_prompts(args.prompts_file, "--prompts-file")
    if not args.prompt and not args.prompts_file and not sys.stdin.isatty():
        lines = utf8_text(sys.stdin.buffer.read(), "standard input").splitlines()
        prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError("no prompt: pass --prompt, --prompts-file or lines on standard input")
    if args.skip >= len(prompts):
        raise ValueError(f"--skip {args.skip}: expected at least 0 and fewer than the {len(prompts)} "
                         f"prompts given")
    return prompts[args.skip:][:args.limit]


@contextmanager
def stopping_on_ctrl_c():
    """While there is nothing to keep (parsing, imports, loading), Ctrl-C ends the process at once
    with one line and status 130: a KeyboardInterrupt raised inside a library's import can be
    swallowed by it, or end the process by signal after a traceback. Signal handlers belong to
    the main thread; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stop(signum, frame) -> None:
    print("[interrupted]", file=sys.stderr, flush=True)
    os._exit(130)


def main(argv: list[str] | None = None) -> None:
    try:
        with stopping_on_ctrl_c():
            args = parser().parse_args(argv)
            generator, prompts, decodings = prepare(args)
        run(generator, prompts, decodings, args)
    except KeyboardInterrupt:    # raised by code rather than by a signal, or after generation
        print("[interrupted]", file=sys.stderr)
        raise SystemExit(130) from None


def prepare(args):
    """Check every input, then load the engine and make the batches (every prompt checked before
    any runs): ``(generator, prompts, decodings)``, or one line on bad input."""
    from common.outputs import writable_file

    try:
        check_flags(args)
        if args.trace:
            writable_file(args.trace, "--trace")
        prompts = read_prompts(args)
        from runtime.decoding.draft_schedule import LoadSchedule
        from runtime.decoding.generator import Generator

        if sys.stderr.isatty():   # a few seconds of ONNX Runtime preparing the graphs: say so
            print(f"loading {args.engine} ({args.backend} backend) ...", file=sys.stderr, flush=True)
        generator = Generator.from_engine(args.engine, backend=args.backend, threads=args.threads)
        if args.batch_size and args.batch_size > generator.backend.limits.max_batch:
            raise ValueError(f"--batch-size {args.batch_size}: expected at most "
                             f"{generator.backend.limits.max_batch}, the engine's --max-batch")
        args.schedule = fixed_schedule(args, generator)
        if args.all_turns:   # each conversation's first turn is checked now (with nothing measured
            # yet: a fixed schedule), the later ones as they come
            fixed = args.schedule or LoadSchedule.constant(generator.backend.limits.k)
            for turns in prompts:
                generator.conversation(system_messages(args) + [{"role": "user", "content": turns[0]}],
                                       **{**_options(args), "draft_schedule": fixed})
            return generator, prompts, None
        decodings = _decodings(generator, prompts, args)
    except ValueError as err:   # CheckpointError and ManifestError are ValueErrors too
        raise SystemExit(f"error: {err}") from None
    return generator, prompts, decodings


def _decodings(generator, prompts: list[str], args) -> list:
    return generator.decodings(
        prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, repetition_penalty=args.repetition_penalty,
        seed=args.seed, speculative=not args.no_spec,
        confidence_threshold=args.confidence_threshold, chat_template=not args.no_chat_template,
        system=args.system, stop=args.stop, draft_schedule=args.schedule,
        batch_size=1 if args.stream else args.batch_size)


def _options(args) -> dict:
    """A conversation turn's generation options, from the flags."""
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, repetition_penalty=args.repetition_penalty, seed=args.seed,
                speculative=not args.no_spec, confidence_threshold=args.confidence_threshold,
                stop=args.stop, draft_schedule=args.schedule)


def system_messages(args) -> list[dict]:
    """The conversation's opening: the --system message, if given."""
    return [{"role": "system", "content": args.system}] if args.system else []


def run_conversations(generator, conversations: list[list[str]], args) -> list:
    """Each conversation turn by turn, every answer in the next turn's prompt, printed as it
    ends (with --stream, as it is accepted); returns the turns' decodings."""
    decodings = []
    for turns in conversations:
        messages, decoding = system_messages(args), None
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            try:   # each turn in the previous one's caches: it prefills only what the turn added
                decoding = generator.conversation(messages, after=decoding, **_options(args))
            except ValueError as err:   # a later turn over the KV capacity: named, the rest run
                print(f"error: {err} (at turn {len(messages) // 2 + 1} of {turns[0][:40]!r})",
                      file=sys.stderr)
                break
            decodings.append(decoding)
            print(f"### {turn}", flush=True)
            if args.stream:
                for piece in generator.pieces(decoding):
                    print(piece, end="", flush=True)
            else:
                for _ in decoding:
                    pass
            answer = generator.collect([decoding]).texts[0]
            print(f"{'' if args.stream else answer}\n", flush=True)
            messages.append({"role": "assistant", "content": answer})
    return decodings


def run(generator, prompts: list[str], decodings: list, args) -> None:
    """Generate batch by batch (with --stream, prompt by prompt, printing text as it is
    accepted), then print the texts, statistics and trace; Ctrl-C stops cleanly and still reports
    what was generated."""
    if args.all_turns:
        _report(generator.collect(run_conversations(generator, prompts, args)), args)
        return
    started, interrupted = [], False
    try:
        for decoding in decodings:
            started.append(decoding)
            if args.stream:
                print(f"### {prompts[len(started) - 1]}", flush=True)
                for piece in generator.pieces(decoding):
                    print(piece, end="", flush=True)
                print("\n", flush=True)
            else:
                for _ in decoding:
                    pass
    except KeyboardInterrupt:
        interrupted = True
    result = generator.collect(started)
    if not args.stream:
        for prompt, text in zip(prompts, result.texts):
            print(f"### {prompt}\n{text}\n")
    elif interrupted:
        print(flush=True)   # end the line the interrupted text was on
    _report(result, args)
    if interrupted:
        print(f"[interrupted after {len(result.texts)} of {len(prompts)} prompts started]",
              file=sys.stderr)
        raise SystemExit(130)


def _report(result, args) -> None:
    import json

    if args.trace:
        with args.trace.open("w") as f:
            for record in result.trace:
                f.write(json.dumps(record) + "\n")
    tokens = sum(map(len, result.token_ids))
    if args.stats and tokens:   # nothing to report when stopped in the first prefill
        sys.stdout.flush()      # the texts first where stdout and stderr share a pipe (2>&1 | ...)
        s, t = result.stats, result.times
        lines = [f"tokens {tokens} in {t.total:.3f}s: {result.tokens_per_second:.1f} tokens/s"]
        if s.k and s.steps:
            per_position = " ".join(f"{a:.2f}" for a in s.acceptance_per_position)
            lines += [f"{s.steps} steps verified drafts, tau {s.tau:.3f} tokens per such step",
                      f"acceptance per draft position: {per_position}"]
            if s.idle_steps:   # adaptive verification judged no draft worth verifying in these
                lines.append(f"{s.idle_steps} more steps decoded one token without verifying a draft "
                             f"(--draft-schedule); {s.verified_per_step:.2f} drafts verified per step in all")
        elif s.k:   # adaptive verification found no draft worth verifying
            lines.append(f"{s.idle_steps} steps decoded one token each, none verifying a draft "
                         f"(--draft-schedule)")
        else:   # target-only decoding: a token per step, nothing drafted
            lines.append(f"decode steps {s.steps} (target only, no drafts)")
        lines.append("time: " + ", ".join(
            f"{name} {getattr(t, name):.3f}s ({100 * getattr(t, name) / t.total:.0f}%)"
            for name in ("prefill", "draft", "verify", "host")))
        print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
