"""``distill()``: one run, from the target to a measured draft in ``OUT``; each step lives in its
own module (see the package's docstring)."""
from __future__ import annotations

from pathlib import Path

import torch

from modeling.checkpoint import resolve
from modeling.target import load_target

from .checkpoint import load_trainer
from .data import prepare_data, prepare_held_out
from .draft_init import check_taps, default_taps, draft_config, init_layers, new_draft, num_target_layers
from .engine import open_engine
from .evaluate import measure_tau
from .loop import DistillResult, train
from .options import DistillSpec
from .prompts import load_tokenizer, read_prompts, write_training_record
from .vocabulary import draft_vocabulary


def distill(target_path: str | Path, out: Path, spec: DistillSpec) -> DistillResult:
    """Generate (or reuse) the data, build (or resume) the draft, train it to ``spec.steps`` and
    measure its acceptance on held-out prompts."""
    torch.manual_seed(spec.seed)
    out.mkdir(parents=True, exist_ok=True)
    target_dir = resolve(target_path, "target")
    settings = spec.settings(target_dir)
    trainer = load_trainer(out, settings)     # before anything in ``out`` changes
    num_layers = num_target_layers(target_dir)
    engine = open_engine(spec.engine, target_dir, spec.taps) if spec.engine is not None else None
    taps = (tuple(spec.taps) if spec.taps is not None
            else tuple(engine.manifest["draft"]["target_layer_ids"]) if engine is not None
            else default_taps(num_layers))
    check_taps(taps, num_layers)
    sources = init_layers(spec, num_layers)
    target = load_target(target_dir, taps=taps)
    tokenizer = load_tokenizer(target_dir)
    mask = spec.mask_token_id
    if mask is None:
        mask = next((i for i in (tokenizer.pad_token_id, tokenizer.unk_token_id) if i is not None), 0)
    vocab = target.config.vocab_size
    if mask >= vocab:
        raise ValueError(f"--mask-token-id {mask}: outside the target's vocabulary of {vocab} ids")
    if spec.draft_vocab is not None and spec.draft_vocab >= vocab:
        raise ValueError(f"--draft-vocab {spec.draft_vocab}: expected fewer than the target's {vocab} "
                         f"ids (leave it out for the full vocabulary)")
    records, held_out = read_prompts(spec, tokenizer)
    eval_prompts = next(iter(held_out.values()), [])
    write_training_record(out, spec)
    data = prepare_data(out / "data.pt", target, tokenizer, records, spec, settings, engine)

    kept = None
    if spec.draft_vocab is not None:
        kept = draft_vocabulary(data["prompts"] + data["continuations"], spec.draft_vocab, mask, vocab)
    config = draft_config(target_dir, target, spec, taps, mask, kept)
    draft = new_draft(out, target, config, kept, sources)
    if trainer is not None:
        unexpected = draft.load_state_dict(trainer["weights"], strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"{out}/trainer.pt holds weights the draft does not have "
                             f"({', '.join(unexpected[:3])})")
    held_answers = None
    if spec.eval_every:
        held_answers = prepare_held_out(out / "held_out.pt", target, held_out, spec, settings, engine)
    result = train(draft, target, data, spec, out, trainer, kept, settings, engine, held_answers)
    if eval_prompts:
        result.tau = measure_tau(target, out, eval_prompts, spec.max_new_tokens)
    return result
