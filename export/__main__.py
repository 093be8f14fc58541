"""``python -m export``: the command line of the export side."""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from .checkpoint import CheckpointError
from .draft_config import LAYOUTS
from .tiny import TinySpec, make_tiny


def _output_dir(path: Path, force: bool, flag: str = "--out") -> Path:
    """Refuse to write into a non-empty directory unless ``--force`` says it may be replaced."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        if not force:
            raise SystemExit(f"error: {flag} {path} exists and is not empty; pass --force to replace it")
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


def cmd_make_tiny(args: argparse.Namespace) -> None:
    out = _output_dir(Path(args.out), args.force, flag="OUT")
    spec = TinySpec(arch=args.arch, draft_format=args.draft_format, draft_vocab=args.draft_vocab,
                    layout=args.layout, block_size=args.block_size, seed=args.seed)
    target, draft = make_tiny(out, spec)
    print(f"wrote tiny {args.arch} target to {target}\n"
          f"wrote tiny {args.draft_format} DSpark draft ({args.layout}) to {draft}")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="python -m export",
                                   description="Export DSpark speculative decoding pairs.")
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tiny = commands.add_parser("make-tiny", help="write a tiny random target + DSpark draft pair",
                               description="Write OUT/target (a transformers checkpoint with a "
                                           "character tokenizer) and OUT/draft (a DSpark draft), "
                                           "random weights, for tests and demos.")
    tiny.add_argument("out", metavar="OUT", help="output directory")
    tiny.add_argument("--arch", choices=["qwen3", "llama"], default="qwen3",
                      help="target architecture (llama ties its embeddings) [qwen3]")
    tiny.add_argument("--draft-format", choices=["native", "speculators"], default="native",
                      help="DeepSpec native config or Speculators config [native]")
    tiny.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                      help="reduced draft vocabulary of N ids with a d2t map [the target's]")
    tiny.add_argument("--layout", choices=LAYOUTS, default=LAYOUTS[0],
                      help="block layout the draft is declared with [anchor-first]")
    tiny.add_argument("--block-size", type=int, default=4, help="trained block width [4]")
    tiny.add_argument("--seed", type=int, default=0, help="random seed [0]")
    tiny.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    tiny.set_defaults(run=cmd_make_tiny)
    return root


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except (CheckpointError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
