"""``train()``: the optimisation loop (AdamW, warm-up then cosine, one sequence per step), the
target's taps it reads, and ``DistillResult``, what a run reports."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from modeling.dense import TargetStep
from modeling.draft import DraftStep
from modeling.target import from_start

from .checkpoint import atomic, check_same, save
from .engine import taps as engine_taps
from .evaluate import teacher_forced_tau
from .loss import block_loss, teacher_forced_logits
from .options import DATA_SETTINGS, DistillSpec

# keep every sequence's taps (fp16) when they fit in this, in OUT/taps.pt and mapped from there:
# a million rows of the demo target's taps take 3.5 GB; recomputing one per step would cost more
# than the step, and computing them all again for a resumed run or another model on the same
# data.pt costs minutes
TAP_CACHE_BYTES = 8 << 30


@dataclass
class DistillResult:
    steps: int                      # the steps trained, all runs together
    resumed_from: int               # the step this run started at (0: a fresh run)
    losses: list[float] = field(default_factory=list)   # one per step, all runs together
    tau: float | None = None        # held-out greedy acceptance (tokens per verify step), decoded
    # every evaluation, all runs together: {"step", "tau": {set: teacher-forced tau}}
    evals: list[dict] = field(default_factory=list)
    stopped: bool = False           # stopped early: --patience evaluations without a better one

    @property
    def best(self) -> dict | None:
        """The evaluation OUT's draft is (the best mean tau over the sets; the earliest of equals)."""
        return max(self.evals, key=score, default=None)


def score(evaluation: dict) -> float:
    """What picks the checkpoint: the mean of the sets' teacher-forced tau."""
    return sum(evaluation["tau"].values()) / len(evaluation["tau"])


@torch.enable_grad()
def train(draft: DraftStep, target: TargetStep, data: dict, spec: DistillSpec, out: Path,
          trainer: dict | None, kept: torch.Tensor | None, settings: dict, engine=None,
          held_out: dict[str, dict] | None = None) -> DistillResult:
    """AdamW on everything but the embeddings, one sequence per step; the sequence and its anchors
    are drawn from a generator seeded by ``(seed, step)``, so a resumed run continues the same
    draws. The target's taps come from ``engine`` where given (``distill.engine``). Every
    ``--eval-every`` steps the draft's teacher-forced tau on each set of ``held_out``
    (``data.prepare_held_out``) is measured; OUT's draft is then the best so far, and
    ``--patience`` evaluations without a better one end the run."""
    sequences = [(torch.tensor(p + c), len(p)) for p, c in zip(data["prompts"], data["continuations"])
                 if len(c) >= 2]     # an anchor needs a generated token after it
    if not sequences:
        raise ValueError(f"the target generated fewer than 2 tokens for every prompt; raise "
                         f"--max-new-tokens ({spec.max_new_tokens}) or use other --prompts")
    to_draft = None
    if kept is not None:
        to_draft = torch.full((draft.target_vocab_size,), -100, dtype=torch.long)
        to_draft[kept] = torch.arange(len(kept))
    draft.train()
    parameters = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=spec.lr, weight_decay=0.01)
    start, losses, evals = 0, [], []
    if trainer is not None:
        optimizer.load_state_dict(trainer["optimizer"])
        start, losses, evals = trainer["step"], list(trainer["losses"]), list(trainer.get("evals", []))
    identity = {key: settings[key] for key in DATA_SETTINGS} | {"taps": list(target.taps)}
    taps = _TapCache(target, sequences, spec.progress, engine, (out / "taps.pt", identity))
    held = {}
    if spec.eval_every and held_out:
        for name, records in held_out.items():
            pairs = [(torch.tensor(p + c), len(p))
                     for p, c in zip(records["prompts"], records["continuations"]) if len(c) >= 2]
            tapped = _TapCache(target, pairs, False, engine)
            held[name] = [(tokens, length, tapped[i]) for i, (tokens, length) in enumerate(pairs)]
    result = DistillResult(steps=start, resumed_from=start, losses=losses, evals=evals)
    # sequences are drawn by their number of anchors, so every generated token is as likely a target
    anchors_per_sequence = torch.tensor([t.numel() - 1 - p for t, p in sequences], dtype=torch.float)

    bar = tqdm(range(start, spec.steps), initial=start, total=spec.steps, desc="distill", unit="step",
               disable=not spec.progress)
    for step in bar:
        if _out_of_patience(result, spec.patience):
            result.stopped = True
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(spec, step)
        generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + step)
        index = int(torch.multinomial(anchors_per_sequence, 1, generator=generator))
        tokens, prompt_length = sequences[index]
        candidates = torch.arange(prompt_length, tokens.numel() - 1)   # generated tokens with a next one
        pick = torch.randperm(candidates.numel(), generator=generator)[:spec.batch_anchors]
        logits, labels = teacher_forced_logits(draft, taps[index].float(), tokens,
                                               candidates[pick].sort().values)
        loss = block_loss(logits, labels, to_draft, spec.loss_decay)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        done = result.steps = step + 1
        evaluated = bool(held) and (done % spec.eval_every == 0 or done == spec.steps)
        if evaluated:
            evals.append({"step": done, "tau": {name: teacher_forced_tau(draft, sequences, kept)
                                                for name, sequences in held.items()}})
            bar.write(f"step {done}: held-out tau " + ", ".join(f"{name} {tau:.3f}"
                                                                  for name, tau in evals[-1]["tau"].items()))
        if evaluated or done % spec.save_every == 0 or done == spec.steps:
            # with evaluations, OUT's draft is the best one: it is written when one is better
            save(out, draft, optimizer, done, losses, settings, evals,
                 draft_file=not held or not evals or (evaluated and result.best is evals[-1]))
    bar.close()
    draft.eval()
    return result


def _out_of_patience(result: DistillResult, patience: int) -> bool:
    """Whether the last ``patience`` evaluations (0: never) came after the best one."""
    return bool(patience) and bool(result.evals) and \
        len(result.evals) - 1 - result.evals.index(result.best) >= patience


class _TapCache:
    """The target's taps ``[S, T*H]`` of each training sequence (teacher forcing, no grad), by the
    PyTorch target or an engine's. When all of them fit in ``TAP_CACHE_BYTES`` they are computed
    up front in fp16; with ``saved = (path, identity)`` they are kept in ``path`` and read back,
    memory-mapped, by a later run whose data and taps ``identity`` names the same (another's is
    refused in one line, as ``data.pt`` is). Else they are recomputed per step."""

    def __init__(self, target: TargetStep, sequences: list[tuple[torch.Tensor, int]], progress: bool,
                 engine=None, saved: tuple[Path, dict] | None = None):
        self.target, self.sequences, self.engine = target, sequences, engine
        if engine is not None:
            engine.start(1)
        width = len(target.taps) * target.config.decoder.hidden_size
        lengths = [t.numel() for t, _ in sequences]
        self.cache = None
        if sum(lengths) * width * 2 > TAP_CACHE_BYTES:
            return
        if saved is not None and saved[0].is_file():
            stored = torch.load(saved[0], mmap=True)
            check_same(stored["settings"], saved[1], saved[0].parent)
            if stored["lengths"] != lengths:
                raise ValueError(f"{saved[0]}: taps of other sequences than {saved[0].parent}/data.pt's; "
                                 f"delete it to compute them again")
            self.cache = stored["rows"].split(lengths)
            return
        rows = tqdm(range(len(sequences)), desc="target taps", unit="seq", disable=not progress)
        self.cache = [self._taps(i).half() for i in rows]
        if saved is not None:
            state = {"settings": saved[1], "lengths": lengths, "rows": torch.cat(self.cache)}
            atomic(lambda tmp: torch.save(state, tmp), saved[0])
            self.cache = state["rows"].split(lengths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.cache[index] if self.cache is not None else self._taps(index)

    @torch.no_grad()
    def _taps(self, index: int) -> torch.Tensor:
        tokens = self.sequences[index][0]
        if self.engine is not None:
            return engine_taps(self.engine, tokens)
        # no logit rows: distillation reads the taps only, so the lm_head is not run
        no_rows = torch.zeros(1, 0, dtype=torch.long)
        return from_start(self.target, tokens[None], no_rows)[1][0]


def learning_rate(spec: DistillSpec, step: int) -> float:
    """Linear warm-up over ``--warmup`` steps, then a cosine from ``--lr`` down to a tenth of it at
    ``--steps``: a function of the step and ``--steps`` only, so a run resumed with the same
    ``--steps`` continues the same schedule."""
    warm = min(1.0, (step + 1) / spec.warmup) if spec.warmup else 1.0
    progress = min(1.0, step / spec.steps)
    return spec.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
