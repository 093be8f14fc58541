"""What ``python -m distill`` prints at the end of a run."""
from __future__ import annotations

import math
from pathlib import Path

from .loop import DistillResult


def summary(result: DistillResult, out: Path, eval_prompts: int) -> str:
    """What the command prints at the end."""
    losses = result.losses
    window = max(1, min(10, len(losses) // 2))
    resumed = f" (resumed at {result.resumed_from})" if result.resumed_from else ""
    lines = [f"wrote the DSpark draft to {out}", f"  steps {result.steps}{resumed}"]
    if losses:
        first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
        lines.append(f"  loss {losses[-1]:.4f} (mean of the first {window} steps {first:.4f}, "
                     f"of the last {window} {last:.4f})")
    best = result.best
    if best is not None:
        stopped = (f", stopped after {len(result.evals) - 1 - result.evals.index(best)} evaluations without "
                   f"a better one" if result.stopped else "")
        lines.append(f"  the draft of step {best['step']}, the best of {len(result.evals)} "
                     f"evaluations{stopped}; teacher-forced held-out tau: "
                     + ", ".join(f"{name} {tau:.3f}" for name, tau in best["tau"].items()))
    if result.tau is not None and not math.isnan(result.tau):
        lines.append(f"  tau {result.tau:.3f} tokens per verify step, greedy, on {eval_prompts} "
                     f"held-out prompts")
    return "\n".join(lines)
