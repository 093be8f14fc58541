"""``python -m runtime.chat``: a conversation with an engine, as llama.cpp's ``llama-cli`` has one.
Each line typed is a user turn; the answer streams as drafts are accepted, and the conversation so
far is the next turn's prompt (its caches are kept between turns: a turn prefills only what the
conversation added). ``/reset`` starts over, ``/help`` lists the commands; ``/quit``, an empty line or
end of input ends it. Ctrl-C stops the answer being generated, a second one the chat.
"""
from __future__ import annotations

import sys

from runtime.generate import (
    add_draft_schedule,
    check_flags,
    fixed_schedule,
    stopping_on_ctrl_c,
    system_messages,
)

HELP = ("/reset starts the conversation over; /quit, an empty line or end of input ends it; "
        "/help shows this")


def parser():
    from common.cli_parser import Parser
    from runtime.backends import BACKENDS

    p = Parser(prog="python -m runtime.chat", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="engine directory")
    p.add_argument("--backend", choices=BACKENDS, default="ort", help="[ort]")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads [all cores]")
    p.add_argument("--system", metavar="TEXT", help="a system message that opens the conversation")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per answer [256]")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy [0]")
    p.add_argument("--top-p", type=float, default=1.0, help="[1.0]")
    p.add_argument("--top-k", type=int, default=0, help="0: every token [0]")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="P", help="1: off [1.0]")
    p.add_argument("--seed", type=int, default=0, help="[0]")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end an answer at this text (repeatable)")
    p.add_argument("--no-spec", action="store_true", help="target-only decoding")
    add_draft_schedule(p)
    p.add_argument("--stats", action="store_true", help="tau and tokens/s after each answer")
    return p


def main(argv: list[str] | None = None) -> None:
    with stopping_on_ctrl_c():
        args = parser().parse_args(argv)
        try:
            check_flags(args)
            from runtime.decoding.generator import Generator

            generator = Generator.from_engine(args.engine, backend=args.backend, threads=args.threads)
            if not generator.tokenizer.chat_template:
                raise ValueError(f"{args.engine}: its tokenizer has no chat template, which a chat needs")
            schedule = fixed_schedule(args, generator)
        except ValueError as err:   # CheckpointError and ManifestError are ValueErrors too
            raise SystemExit(f"error: {err}") from None
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, repetition_penalty=args.repetition_penalty, seed=args.seed,
                   speculative=not args.no_spec, stop=args.stop, draft_schedule=schedule)
    system = system_messages(args)
    messages, decoding = list(system), None
    interactive = sys.stdin.isatty()
    sys.stdin.reconfigure(errors="surrogateescape")   # a line that is not UTF-8 is refused alone
    for number in range(1, sys.maxsize):
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            break
        command = line.strip()
        if command in ("", "/quit"):
            break
        if command == "/reset":
            messages, decoding = list(system), None
            print("[the conversation starts over]", file=sys.stderr, flush=True)
            continue
        if command == "/help":
            print(HELP, file=sys.stderr, flush=True)
            continue
        if (byte := _escaped_byte(line)) is not None:
            print(f"error: standard input line {number}: not UTF-8 text (byte {byte:#04x}); it was not "
                  f"sent", file=sys.stderr, flush=True)
            continue
        messages.append({"role": "user", "content": line})
        try:
            decoding = generator.conversation(messages, after=decoding, **options)
        except ValueError as err:   # the conversation no longer fits the engine's KV capacity
            print(f"error: {err}; /reset starts over", file=sys.stderr, flush=True)
            messages.pop()
            continue
        try:
            for piece in generator.pieces(decoding):
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        print("\n", flush=True)
        answer = generator.collect([decoding])
        messages.append({"role": "assistant", "content": answer.texts[0]})
        if args.stats:
            s = answer.stats
            print(f"[{sum(map(len, answer.token_ids))} tokens, {answer.tokens_per_second:.1f} tokens/s"
                  + (f", tau {s.tau:.2f}" if s.k and s.steps else "") + "]", file=sys.stderr, flush=True)


def _escaped_byte(line: str) -> int | None:
    """The first byte of ``line`` that was not UTF-8 (read with ``surrogateescape``), or None."""
    return next((ord(c) - 0xDC00 for c in line if 0xDC80 <= ord(c) <= 0xDCFF), None)


if __name__ == "__main__":
    main(sys.argv[1:])
