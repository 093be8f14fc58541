"""``python -m distill``: the command line of draft distillation. What a run needs (torch, the
target, the runtime) is imported when it runs, so that ``--help`` and flag errors come at once."""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from common.cli_parser import Parser
from common.errors import run_command
from common.outputs import check_replaceable
from common.prompts import DEFAULT_PROMPTS

from .options import DistillSpec

INTERRUPTED = "rerun the same command to resume from the last checkpoint in --out"


def cmd_distill(args: argparse.Namespace) -> None:
    from .checkpoint import is_run
    from .run import distill
    from .summary import summary

    taps = None
    if args.taps is not None:
        try:
            taps = tuple(int(t) for t in args.taps.split(","))
        except ValueError:
            raise ValueError(f"--taps {args.taps}: expected comma-separated layer ids, e.g. 1,9,17") from None
    spec = DistillSpec(prompts=tuple(Path(p) for p in args.prompts), num_prompts=args.num_prompts,
                       held_out=args.held_out, eval_prompts=args.eval_prompts,
                       max_new_tokens=args.max_new_tokens, samples=args.samples, synthetic=args.synthetic,
                       follow_ups=args.follow_ups,
                       engine=None if args.engine is None else Path(args.engine),
                       layers=args.layers, block_size=args.block_size, markov_rank=args.markov_rank,
                       taps=taps, draft_vocab=args.draft_vocab, mask_token_id=args.mask_token_id,
                       init_layer=args.init_layer,
                       steps=args.steps, eval_every=args.eval_every, patience=args.patience, lr=args.lr,
                       warmup=args.warmup, batch_anchors=args.batch_anchors,
                       loss_decay=args.loss_decay, save_every=args.save_every, seed=args.seed,
                       progress=not args.quiet)
    out = Path(args.out)
    if args.force or not is_run(out):  # a distill run in --out is resumed, anything else is refused
        check_replaceable(out, args.force, "--out", sources=(Path(args.target), *spec.prompts))
        from modeling.checkpoint import resolve

        resolve(args.target, "target")   # a mistyped --target fails before a run is removed
        shutil.rmtree(out, ignore_errors=True)
    result = distill(args.target, out, spec)
    print(summary(result, out, spec.eval_prompts))


def _init_layer(value: str) -> int | None:
    if value == "random":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a layer index or 'random', not {value!r}") from None


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m distill",
                                description="Let the target answer prompts greedily, then train a fresh "
                                            "native DSpark draft (the target's embeddings, frozen) to "
                                            "predict those answers block by block, as DeepSpec does. "
                                            "Checkpoints go to --out every --save-every steps; "
                                            "rerunning the same command resumes there.")
    p.add_argument("--target", required=True, help="target checkpoint: directory, .gguf file or hub id")
    p.add_argument("--out", required=True, help="draft directory (also holds data.pt and trainer.pt)")
    p.add_argument("--prompts", nargs="+", default=[str(DEFAULT_PROMPTS)], metavar="FILE",
                   help="JSON Lines files of {\"turns\": [...]}; the first turn of each record is a "
                        "prompt [data/prompts/gsm8k.jsonl]")
    p.add_argument("--num-prompts", type=int, default=64,
                   help="training prompts per file, from the top [64]")
    p.add_argument("--held-out", type=int, default=4,
                   help="records at the end of every file that training never sees, so that they "
                        "can be benchmarked [4]")
    p.add_argument("--eval-prompts", type=int, default=4,
                   help="held-out prompts of each file that acceptance is measured on: every "
                        "--eval-every steps, and at the end by decoding the first file's [4]")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens the target answers with [128]")
    p.add_argument("--samples", type=int, default=0, metavar="N",
                   help="answers per training prompt sampled at T = 1, beside the greedy one, so "
                        "that the draft learns the target's distribution [0]")
    p.add_argument("--synthetic", type=int, default=0, metavar="N",
                   help="N more prompts per --prompts file that the target writes itself, shown "
                        "examples of the file's training records (never its held-out ones) [0]")
    p.add_argument("--follow-ups", action="store_true",
                   help="a second user turn on each greedy answer (the record's own second turn, "
                        "else a generic follow-up), answered greedily too")
    p.add_argument("--engine", metavar="DIR",
                   help="an engine directory built from --target (any draft): the answers and the "
                        "target's taps come from it, batched on its slots and computed as it will "
                        "serve the draft; several times faster on a CPU [the PyTorch target]")
    p.add_argument("--layers", type=int, default=1, help="draft decoder layers [1]")
    p.add_argument("--block-size", type=int, default=4, help="block width = drafts per step [4]")
    p.add_argument("--markov-rank", type=int, default=32, help="rank of the Markov head [32]")
    p.add_argument("--taps", help="target layers the draft reads, DeepSpec convention (-1 = embeddings), "
                                  "comma-separated [--engine's draft's; else 3 spread over the target, "
                                  "never the final layer]")
    p.add_argument("--draft-vocab", type=int, metavar="N",
                   help="reduced draft vocabulary of N ids, with d2t: the mask token and the N-1 "
                        "most frequent ids of the training prompts and answers [the target's]")
    p.add_argument("--mask-token-id", type=int,
                   help="MASK token of the block [the tokenizer's pad/unk id, else 0]")
    p.add_argument("--init-layer", type=_init_layer, default=-1, metavar="L",
                   help="start the draft's decoder layers from the target's: the last one from "
                        "layer L (negative counts from the end), or 'random' [-1: the last layer]")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps in all [1000]")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="every N steps, measure the draft's acceptance on each --prompts file's "
                        "--eval-prompts held-out records (teacher-forced); OUT's draft is then the "
                        "best one so far [0: only once, at the end]")
    p.add_argument("--patience", type=int, default=0, metavar="P",
                   help="stop after P evaluations without a better held-out acceptance [0: never]")
    p.add_argument("--lr", type=float, default=2e-3,
                   help="peak AdamW learning rate, cosine-decayed to a tenth at --steps [2e-3]")
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps [50]")
    p.add_argument("--batch-anchors", type=int, default=128,
                   help="anchors (blocks) per step, from one sequence [128]")
    p.add_argument("--loss-decay", type=float, metavar="GAMMA",
                   help="weigh block row j by exp(-j / GAMMA) [uniform]")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint interval in steps [100]")
    p.add_argument("--seed", type=int, default=0, help="random seed [0]")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out (and start over)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    run_command(lambda: cmd_distill(args), INTERRUPTED)


if __name__ == "__main__":
    main(sys.argv[1:])
