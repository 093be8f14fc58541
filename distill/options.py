"""``DistillSpec``: the options of a distill run, checked on construction so that a bad flag fails
before any work, and the settings that identify a run in ``OUT``."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from common.prompts import DEFAULT_PROMPTS

# settings a resumed run must share with the run that wrote OUT (the rest may change)
DATA_SETTINGS = ("target", "prompts", "num_prompts", "held_out", "max_new_tokens", "samples", "synthetic",
                 "follow_ups", "engine")
MODEL_SETTINGS = ("layers", "block_size", "markov_rank", "taps", "draft_vocab", "mask_token_id",
                  "init_layer", "seed")


@dataclass(frozen=True)
class DistillSpec:
    """The command's options; checked on construction so that a bad flag fails before any work."""

    prompts: tuple[Path, ...] = (DEFAULT_PROMPTS,)
    num_prompts: int = 64                      # per file, from the top
    held_out: int = 4                          # records at the end of every file never trained on
    eval_prompts: int = 4                      # of each file's held-out records, for tau
    max_new_tokens: int = 128
    samples: int = 0                           # answers per prompt sampled at T = 1, beside the greedy one
    synthetic: int = 0                         # prompts per file the target writes in the file's style
    follow_ups: bool = False                   # a second turn on each greedy answer, answered too
    engine: Path | None = None                 # an engine directory of the target to generate through
    layers: int = 1
    block_size: int = 4
    markov_rank: int = 32
    taps: tuple[int, ...] | None = None        # DeepSpec convention; None: default_taps()
    draft_vocab: int | None = None
    mask_token_id: int | None = None           # None: the tokenizer's pad / unk id, else 0
    init_layer: int | None = -1                # target layer the last draft layer starts from
                                               # (Python index); None: random weights
    steps: int = 1000
    eval_every: int = 0                        # held-out acceptance every N steps (0: at the end only)
    patience: int = 0                          # evaluations without a better one before stopping (0: never)
    lr: float = 2e-3
    warmup: int = 50
    batch_anchors: int = 128
    loss_decay: float | None = None            # row j weighs exp(-j / decay); None: uniform
    save_every: int = 100
    seed: int = 0
    progress: bool = True

    def __post_init__(self):
        at_least = {"--num-prompts": (self.num_prompts, 1), "--eval-prompts": (self.eval_prompts, 0),
                    "--held-out": (self.held_out, 0), "--warmup": (self.warmup, 0),
                    "--samples": (self.samples, 0), "--synthetic": (self.synthetic, 0),
                    "--eval-every": (self.eval_every, 0), "--patience": (self.patience, 0),
                    "--max-new-tokens": (self.max_new_tokens, 2), "--layers": (self.layers, 1),
                    "--block-size": (self.block_size, 2), "--markov-rank": (self.markov_rank, 1),
                    "--steps": (self.steps, 1), "--batch-anchors": (self.batch_anchors, 1),
                    "--save-every": (self.save_every, 1), "--draft-vocab": (self.draft_vocab, 2),
                    "--mask-token-id": (self.mask_token_id, 0)}
        for flag, (value, minimum) in at_least.items():
            if value is not None and value < minimum:
                raise ValueError(f"{flag} {value}: expected at least {minimum}")
        for flag, value in (("--lr", self.lr), ("--loss-decay", self.loss_decay)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag} {value}: expected a positive number")
        if self.taps is not None and (not self.taps or list(self.taps) != sorted(set(self.taps))):
            raise ValueError(f"--taps {','.join(map(str, self.taps))}: expected strictly increasing "
                             f"layer ids")
        if self.eval_every and not self.eval_prompts:
            raise ValueError(f"--eval-every {self.eval_every}: needs --eval-prompts (held-out prompts "
                             f"of each file to measure acceptance on)")
        if self.patience and not self.eval_every:
            raise ValueError(f"--patience {self.patience}: needs --eval-every (it counts evaluations)")
        if self.eval_prompts > self.held_out:
            raise ValueError(f"--eval-prompts {self.eval_prompts}: expected at most --held-out "
                             f"{self.held_out} (tau is measured on held-out prompts)")
        for path in self.prompts:
            if not Path(path).is_file():
                raise ValueError(f"--prompts {path}: no such file")
        if self.engine is not None and not Path(self.engine).is_dir():
            raise ValueError(f"--engine {self.engine}: no such directory (an engine built from --target)")

    def settings(self, target: Path) -> dict:
        """What identifies a run in ``OUT``: the data and the model, not the schedule."""
        values = asdict(self) | {"target": str(target.resolve()),
                                 "prompts": [str(Path(p).resolve()) for p in self.prompts],
                                 "engine": None if self.engine is None else str(Path(self.engine).resolve())}
        values["taps"] = list(values["taps"]) if values["taps"] is not None else None
        return {key: values[key] for key in DATA_SETTINGS + MODEL_SETTINGS}
