"""What a run keeps in ``OUT`` between runs: the loadable draft (``model.safetensors``, beside the
``config.json`` that ``draft_init.new_draft`` writes) and ``trainer.pt`` to resume from, each
replaced atomically; and the check that a resumed run is the same run."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from modeling.checkpoint import write_tensors
from modeling.draft import DraftStep


def is_run(out: Path) -> bool:
    """Whether ``out`` holds a distill run to resume."""
    return (out / "trainer.pt").is_file() or (out / "data.pt").is_file()


def save(out: Path, draft: DraftStep, optimizer, step: int, losses: list[float], settings: dict,
         evals: list[dict] = (), draft_file: bool = True) -> None:
    """``model.safetensors`` (fp16; ``d2t`` int64) in the native layout unless ``draft_file`` is
    False (it holds the best evaluated draft), then ``trainer.pt`` (the fp32 trainable weights,
    the optimizer, the step, the evaluations so far), each replaced atomically. The embedding is the
    target's and is shared at load time (``docs/dspark.md#shared-and-ignored-tensors``); a reduced
    vocabulary keeps its own ``lm_head`` and ``d2t``."""
    reduced = draft.config.draft_vocab_size < draft.target_vocab_size
    dropped = {"embed_tokens.weight"} | (set() if reduced else {"lm_head.weight", "d2t"})
    tensors = {name: (t.half() if t.is_floating_point() else t.long()).contiguous()
               for name, t in draft.state_dict().items() if name not in dropped}
    if draft_file:
        atomic(lambda tmp: write_tensors(tensors, tmp), out / "model.safetensors")
    weights = {name: p.detach().clone() for name, p in draft.named_parameters() if p.requires_grad}
    state = {"step": step, "losses": losses, "weights": weights, "optimizer": optimizer.state_dict(),
             "settings": settings, "evals": list(evals)}
    atomic(lambda tmp: torch.save(state, tmp), out / "trainer.pt")


def load_trainer(out: Path, settings: dict) -> dict | None:
    """``trainer.pt``'s state to resume from (None for a fresh run), refused when it was written
    with other data or another model."""
    path = out / "trainer.pt"
    if not path.is_file():
        return None
    trainer = torch.load(path)
    check_same(trainer["settings"], settings, out)
    return trainer


def check_same(saved: dict, current: dict, out: Path) -> None:
    """Refuse to resume a run in ``out`` written with other settings (``options.DATA_SETTINGS``,
    ``MODEL_SETTINGS``), naming the first flag that differs."""
    for key, value in current.items():
        if key in saved and saved[key] != value:
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"--out {out} holds a run with {flag} {saved[key]}, not {value}; rerun "
                             f"with the same options to resume, or pass --force to start over")


def atomic(write, path: Path) -> None:
    """``write(tmp)`` then rename over ``path``, so an interrupted save never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)
