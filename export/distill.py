"""``python -m export distill``: train a small DSpark draft for a target on the CPU.

The recipe is DeepSpec's (``docs/dspark.md#the-block-backbone``, ``#the-markov-head``), on data the
target writes itself:

1. the target answers prompts greedily; those sequences are cached in ``OUT/data.pt``;
2. a fresh draft (native DeepSpec config, the target's ``embed_tokens`` / ``lm_head`` copied and
   frozen, its decoder layers started from the target's last ones) learns to continue them: per
   step one sequence runs through the target (teacher forcing) for its taps, anchors are sampled
   in the generated part, and every anchor's block ``[token_p, MASK ...]`` at positions ``p ..``
   attends to the context rows ``< p`` and to its own block, in one dense masked attention for all
   anchors; row ``j`` learns the token at ``p + j + 1`` with the Markov bias of the true
   predecessor ``token_{p + j}``;
3. every ``--save-every`` steps ``OUT`` holds a loadable draft (``config.json`` +
   ``model.safetensors``) and ``trainer.pt`` (fp32 weights, optimizer, step), so rerunning the
   same command resumes.
"""
from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .checkpoint import hf_location, read_config, resolve, write_tensors
from .draft_config import load_draft_config
from .draft_model import DraftStep, load_draft
from .prompts import DEFAULT_PROMPTS, encode_prompt, read_jsonl_prompts
from .target_model import TargetStep, load_target

GENERATION_BATCH = 16         # prompts the target answers at a time
TAP_CACHE_BYTES = 4 << 30     # keep every sequence's taps (fp16) in memory when they fit in this
# settings a resumed run must share with the run that wrote OUT (the rest may change)
DATA_SETTINGS = ("target", "prompts", "num_prompts", "held_out", "max_new_tokens")
MODEL_SETTINGS = ("layers", "block_size", "markov_rank", "taps", "draft_vocab", "mask_token_id",
                  "init_layer", "seed")
# target config keys a Qwen3 draft must not inherit
NOT_INHERITED = ("auto_map", "quantization_config", "_name_or_path", "_model_name_or_path",
                 "transformers_version", "mlp_bias", "pretraining_tp", "dtype", "torch_dtype",
                 "tie_word_embeddings")


@dataclass(frozen=True)
class DistillSpec:
    """The command's options; checked on construction so that a bad flag fails before any work."""

    prompts: tuple[Path, ...] = (DEFAULT_PROMPTS,)
    num_prompts: int = 64                      # per file, from the top
    held_out: int = 4                          # records at the end of every file never trained on
    eval_prompts: int = 4                      # of the first file's held-out records, for tau
    max_new_tokens: int = 128
    layers: int = 1
    block_size: int = 4
    markov_rank: int = 32
    taps: tuple[int, ...] | None = None        # DeepSpec convention; None: default_taps()
    draft_vocab: int | None = None
    mask_token_id: int | None = None           # None: the tokenizer's pad / unk id, else 0
    init_layer: int | None = -1                # target layer the last draft layer starts from
                                               # (Python index); None: random weights
    steps: int = 1000
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
        if self.eval_prompts > self.held_out:
            raise ValueError(f"--eval-prompts {self.eval_prompts}: expected at most --held-out "
                             f"{self.held_out} (tau is measured on held-out prompts)")
        for path in self.prompts:
            if not Path(path).is_file():
                raise ValueError(f"--prompts {path}: no such file")

    def settings(self, target: Path) -> dict:
        """What identifies a run in ``OUT``: the data and the model, not the schedule."""
        values = asdict(self) | {"target": str(target.resolve()),
                                 "prompts": [str(Path(p).resolve()) for p in self.prompts]}
        values["taps"] = list(values["taps"]) if values["taps"] is not None else None
        return {key: values[key] for key in DATA_SETTINGS + MODEL_SETTINGS}


@dataclass
class DistillResult:
    steps: int                      # the step count OUT's draft was trained for
    resumed_from: int               # the step this run started at (0: a fresh run)
    losses: list[float] = field(default_factory=list)   # one per step, all runs together
    tau: float | None = None        # held-out greedy acceptance (tokens per verify step)


def is_run(out: Path) -> bool:
    """Whether ``out`` holds a distill run to resume."""
    return (out / "trainer.pt").is_file() or (out / "data.pt").is_file()


def distill(target_path: str | Path, out: Path, spec: DistillSpec) -> DistillResult:
    """Generate (or reuse) the data, build (or resume) the draft, train it to ``spec.steps`` and
    measure its acceptance on held-out prompts."""
    torch.manual_seed(spec.seed)
    out.mkdir(parents=True, exist_ok=True)
    target_dir = resolve(target_path, "target")
    settings = spec.settings(target_dir)
    trainer = _load_trainer(out, settings)     # before anything in ``out`` changes
    num_layers = _num_target_layers(target_dir)
    taps = tuple(spec.taps) if spec.taps is not None else default_taps(num_layers)
    _check_taps(taps, num_layers)
    init_layers = _init_layers(spec, num_layers)
    target = load_target(target_dir, taps=taps)
    tokenizer = _tokenizer(target_dir)
    mask = spec.mask_token_id
    if mask is None:
        mask = next((i for i in (tokenizer.pad_token_id, tokenizer.unk_token_id) if i is not None), 0)
    vocab = target.config.vocab_size
    if mask >= vocab:
        raise ValueError(f"--mask-token-id {mask}: outside the target's vocabulary of {vocab} ids")
    if spec.draft_vocab is not None and spec.draft_vocab >= vocab:
        raise ValueError(f"--draft-vocab {spec.draft_vocab}: expected fewer than the target's {vocab} "
                         f"ids (leave it out for the full vocabulary)")
    train_prompts, eval_prompts = read_prompts(spec, tokenizer)
    data = prepare_data(out / "data.pt", target, train_prompts, spec.max_new_tokens, settings, spec.progress)

    kept = None
    if spec.draft_vocab is not None:
        kept = draft_vocabulary(data["prompts"] + data["continuations"], spec.draft_vocab, mask, vocab)
    config = draft_config(_target_config_dict(target_dir), target, spec, taps, mask, kept)
    draft = new_draft(out, target, config, kept, init_layers)
    if trainer is not None:
        unexpected = draft.load_state_dict(trainer["weights"], strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"{out}/trainer.pt holds weights the draft does not have "
                             f"({', '.join(unexpected[:3])})")
    result = train(draft, target, data, spec, out, trainer, kept, settings)
    if eval_prompts:
        result.tau = measure_tau(target, out, eval_prompts, spec.max_new_tokens)
    return result


def default_taps(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """``count`` layers spread from layer 1 to layer ``N - 3``, as in the released drafts
    (``[1, 9, 17, 25, 33]`` of 36); small targets fall back to every layer but the final one,
    which DeepSpec never taps."""
    for low, high in ((1, num_layers - 3), (0, num_layers - 2), (-1, num_layers - 2)):
        if high - low + 1 >= count:
            step = (high - low) / (count - 1) if count > 1 else 0
            return tuple(int(low + i * step + 0.5) for i in range(count))
    return tuple(range(-1, num_layers - 1))


def _check_taps(taps: tuple[int, ...], num_layers: int) -> None:
    outside = [t for t in taps if not -1 <= t <= num_layers - 2]
    if outside:
        raise ValueError(f"--taps {','.join(map(str, taps))}: layer {outside[0]} is outside "
                         f"-1..{num_layers - 2} (DeepSpec convention, -1 = the embedding output; the "
                         f"target has {num_layers} layers and its final one cannot be tapped)")


def _init_layers(spec: DistillSpec, num_layers: int) -> list[int]:
    """The target layers the draft's decoder layers start from, in order: the ``--layers``
    consecutive ones ending at ``--init-layer`` (none for random weights)."""
    if spec.init_layer is None:
        return []
    first = spec.layers - 1          # the lowest layer with --layers layers up to it
    if not first - num_layers <= spec.init_layer < num_layers or 0 <= spec.init_layer < first:
        raise ValueError(f"--init-layer {spec.init_layer}: expected {first}..{num_layers - 1} or "
                         f"{first - num_layers}..-1 (counted from the last of the target's "
                         f"{num_layers} layers) for a {spec.layers}-layer draft, or 'random'")
    last = spec.init_layer % num_layers
    return list(range(last - spec.layers + 1, last + 1))


def _num_target_layers(target_dir: Path) -> int:
    from .target_config import load_target_config

    return load_target_config(target_dir).decoder.num_layers


def _target_config_dict(target_dir: Path) -> dict:
    """The target's config as a dict, which a native draft config is a copy of
    (``docs/dspark.md#checkpoint-and-config-conventions``)."""
    if target_dir.is_dir():
        return read_config(target_dir)
    from transformers import AutoConfig

    location, options = hf_location(target_dir)
    # only what differs from PretrainedConfig's defaults, as a config.json on the hub would hold
    return AutoConfig.from_pretrained(location, **options).to_diff_dict()


def _tokenizer(target_dir: Path):
    from transformers import AutoTokenizer

    location, options = hf_location(target_dir)
    return AutoTokenizer.from_pretrained(location, **options)


def read_prompts(spec: DistillSpec, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids, through the chat template as a user would send them, of the first turn of: the
    first ``--num-prompts`` records of each file short of its last ``--held-out`` (training), and
    the first ``--eval-prompts`` of the first file's held-out records (acceptance)."""
    train, held = [], []
    for index, path in enumerate(spec.prompts):
        texts = read_jsonl_prompts(path, "--prompts")
        if len(texts) <= spec.held_out:
            raise ValueError(f"--prompts {path} holds {len(texts)} prompts; --held-out {spec.held_out} "
                             f"leaves none to train on")
        train += texts[:min(spec.num_prompts, len(texts) - spec.held_out)]
        if index == 0:
            held = texts[len(texts) - spec.held_out:][:spec.eval_prompts]
    return [encode_prompt(tokenizer, t) for t in train], [encode_prompt(tokenizer, t) for t in held]


def prepare_data(path: Path, target: TargetStep, prompts: list[list[int]], max_new_tokens: int,
                 settings: dict, progress: bool) -> dict:
    """``{"prompts", "continuations"}``: the target's own greedy answers, which are what the draft
    will be asked to predict. Cached in ``path`` so that a resumed run does not regenerate them."""
    wanted = {key: settings[key] for key in DATA_SETTINGS}
    if path.is_file():
        data = torch.load(path)
        _check_same(data["settings"], wanted, path.parent)
        return data
    from tqdm.auto import tqdm

    from runtime.backend import capacity_needed
    from runtime.speculative import generate
    from runtime.torch_backend import TorchBackend

    continuations: list[list[int]] = [[] for _ in prompts]
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))   # little padding per batch
    batches = range(0, len(prompts), GENERATION_BATCH)
    for begin in tqdm(batches, desc="generating", unit="batch", disable=not progress):
        rows = by_length[begin:begin + GENERATION_BATCH]
        batch = [prompts[i] for i in rows]
        backend = TorchBackend(target, None, capacity_needed(max(map(len, batch)), max_new_tokens))
        result = generate(backend, batch, max_new_tokens=max_new_tokens,
                          eos_token_ids=target.config.eos_token_ids)
        for i, ids in zip(rows, result.token_ids):
            continuations[i] = ids
    data = {"settings": wanted, "prompts": prompts, "continuations": continuations}
    _atomic(lambda tmp: torch.save(data, tmp), path)
    return data


def draft_vocabulary(texts: list[list[int]], size: int, mask: int, vocab: int) -> torch.Tensor:
    """The ``size`` target ids a reduced draft keeps, ascending: the mask token and the most
    frequent ids in the training text, prompts (which answers copy from) and answers (ties: lower
    id first)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for ids in texts:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab)
    counts[mask] = -1
    order = torch.sort(-counts, stable=True).indices
    return torch.cat([order[:size - 1], torch.tensor([mask])]).sort().values


def draft_config(target_raw: dict, target: TargetStep, spec: DistillSpec, taps: tuple[int, ...],
                 mask: int, kept: torch.Tensor | None) -> dict:
    """A native DeepSpec config: a copy of the target's with the draft's fields set, laid out as
    ``export.tiny.write_draft`` writes one (``docs/dspark.md#checkpoint-and-config-conventions``)."""
    d = target.config.decoder
    config = {k: v for k, v in copy.deepcopy(target_raw).items() if k not in NOT_INHERITED}
    config.update(
        architectures=["Qwen3DSparkModel"], model_type="qwen3", num_target_layers=d.num_layers,
        num_hidden_layers=spec.layers, layer_types=["full_attention"] * spec.layers,
        hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
        num_attention_heads=d.num_heads, num_key_value_heads=d.num_kv_heads, head_dim=d.head_dim,
        rms_norm_eps=d.rms_norm_eps, vocab_size=target.config.vocab_size, attention_bias=False,
        hidden_act="silu", tie_word_embeddings=False, target_layer_ids=list(taps),
        block_size=spec.block_size, mask_token_id=mask, num_anchors=spec.batch_anchors,
        markov_rank=spec.markov_rank, markov_head_type="vanilla", enable_confidence_head=False)
    if kept is not None:
        config["draft_vocab_size"] = len(kept)
    return config


def new_draft(out: Path, target: TargetStep, config: dict, kept: torch.Tensor | None,
              init_layers: list[int]) -> DraftStep:
    """Write ``config.json`` and build its ``DraftStep``, read back through the loader's own config
    parser so that what is trained is what loads. ``embed_tokens`` / ``lm_head`` are the target's
    (the kept rows for a reduced vocabulary) and frozen; the Markov head starts at zero bias.

    The decoder layers start from the target's ``init_layers`` (what both models have; a Qwen3
    draft's q/k norms stay at one over a Llama target): on a CPU's worth of data that generalises
    better than random weights (held-out tau 2.03 against 1.96 for the SmolLM2 demo pair)."""
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    decoder = target.config.decoder
    parsed = load_draft_config(out, decoder.num_layers, decoder.hidden_size)
    draft = DraftStep(parsed, target.config.vocab_size, parsed.max_drafts)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.embed_tokens.weight)
        lm_head = target.lm_head.weight
        draft.lm_head.weight.copy_(lm_head if kept is None else lm_head[kept])
        if kept is not None:
            draft.d2t.copy_(kept - torch.arange(len(kept)))
        draft.markov_head.markov_w2.weight.zero_()
        for layer, source in zip(draft.layers, init_layers):
            layer.load_state_dict(target.layers[source].state_dict(), strict=False)
    draft.embed_tokens.requires_grad_(False)
    draft.lm_head.requires_grad_(False)
    return draft


def teacher_forced_logits(draft: DraftStep, aux: torch.Tensor, tokens: torch.Tensor,
                          anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's block logits for every anchor at once, as inference computes them one anchor at
    a time (``DraftStep.write_context`` + ``block_logits`` + the Markov bias), with the true tokens
    as Markov predecessors.

    ``aux [S, T*H]`` are the target's taps of ``tokens [S]``; ``anchors [n]`` are positions.
    Returns ``logits [n, B, V_d]`` (draft space) and ``labels [n, B]``: the target id at
    ``p + j + 1``, or -100 past the end of the sequence."""
    config, block = draft.config, draft.config.block_size
    length, count = tokens.numel(), anchors.numel()
    span = anchors[:, None] + torch.arange(block)                          # [n, B] positions
    seen = int(anchors.max())                                              # context rows any block sees
    context = draft.hidden_norm(draft.fc(aux[None, :seen]))
    ctx_cos, ctx_sin = draft.rotary.cos_sin(torch.arange(seen)[None], context.dtype)
    ids = torch.full((count, block), config.mask_token_id, dtype=torch.long)
    ids[:, 0] = tokens[anchors]
    h = draft.embed_tokens(ids.reshape(1, -1))
    cos, sin = draft.rotary.cos_sin(span.reshape(1, -1), h.dtype)
    mask = block_mask(anchors, seen, block)
    for layer in draft.layers:
        context_kv = layer.self_attn.key_value(context, ctx_cos, ctx_sin)   # skips input_layernorm
        h, _, _ = layer(h, cos, sin, context_kv=context_kv, mask=mask)
    base = draft.lm_head(draft.norm(h)).reshape(count, block, -1)
    predecessors = tokens[span.clamp(max=length - 1)]                      # [anchor, y_1 .. y_{B-1}]
    bias = draft.markov_head.markov_w2(draft.markov_head.markov_w1(predecessors))
    following = span + 1
    labels = torch.where(following < length, tokens[following.clamp(max=length - 1)], -100)
    return base + bias, labels


def block_mask(anchors: torch.Tensor, seen: int, block: int) -> torch.Tensor:
    """``[n*B, seen + n*B]``: a row of anchor ``i``'s block sees the context rows ``< p_i`` and the
    ``B`` rows of its own block (non-causal), nothing of the other blocks."""
    owner = torch.arange(anchors.numel()).repeat_interleave(block)
    sees_context = torch.arange(seen)[None] < anchors.repeat_interleave(block)[:, None]
    return torch.cat([sees_context, owner[:, None] == owner[None]], dim=1)


def block_loss(logits: torch.Tensor, labels: torch.Tensor, to_draft: torch.Tensor | None,
               decay: float | None) -> torch.Tensor:
    """Cross-entropy over the block rows, averaged, row ``j`` weighted ``exp(-j / decay)`` when
    ``decay`` is set (early rows decide acceptance). With a reduced vocabulary the labels move to
    draft ids (``to_draft``); those outside the draft vocabulary cannot be drafted and are skipped."""
    if to_draft is not None:
        labels = torch.where(labels >= 0, to_draft[labels.clamp(min=0)], -100)
    count, block = labels.shape
    rows = torch.arange(block, dtype=torch.float32)
    weight = torch.exp(-rows / decay) if decay else torch.ones(block)
    weight = weight.expand(count, block) * (labels >= 0)
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                         reduction="none")
    return (ce * weight.flatten()).sum() / weight.sum().clamp(min=1e-6)


@torch.enable_grad()
def train(draft: DraftStep, target: TargetStep, data: dict, spec: DistillSpec, out: Path,
          trainer: dict | None, kept: torch.Tensor | None, settings: dict) -> DistillResult:
    """AdamW on everything but the embeddings, one sequence per step; the sequence and its anchors
    are drawn from a generator seeded by ``(seed, step)``, so a resumed run continues the same
    draws."""
    from tqdm.auto import tqdm

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
    start, losses = 0, []
    if trainer is not None:
        optimizer.load_state_dict(trainer["optimizer"])
        start, losses = trainer["step"], list(trainer["losses"])
    taps = _TapCache(target, sequences, spec.progress)
    # sequences are drawn by their number of anchors, so every generated token is as likely a target
    anchors_per_sequence = torch.tensor([t.numel() - 1 - p for t, p in sequences], dtype=torch.float)

    bar = tqdm(range(start, spec.steps), initial=start, total=spec.steps, desc="distill", unit="step",
               disable=not spec.progress)
    for step in bar:
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
        if (step + 1) % spec.save_every == 0 or step + 1 == spec.steps:
            save(out, draft, optimizer, step + 1, losses, settings)
    bar.close()
    draft.eval()
    return DistillResult(steps=max(start, spec.steps), resumed_from=start, losses=losses)


class _TapCache:
    """The target's taps ``[S, T*H]`` of each training sequence (teacher forcing, no grad), computed
    up front in fp16 when all of them fit in ``TAP_CACHE_BYTES``, else recomputed per step."""

    def __init__(self, target: TargetStep, sequences: list[tuple[torch.Tensor, int]], progress: bool):
        from tqdm.auto import tqdm

        self.target, self.sequences = target, sequences
        width = len(target.taps) * target.config.decoder.hidden_size
        fits = sum(t.numel() for t, _ in sequences) * width * 2 <= TAP_CACHE_BYTES
        self.cache = None
        if fits:
            rows = tqdm(range(len(sequences)), desc="target taps", unit="seq", disable=not progress)
            self.cache = [self._taps(i).half() for i in rows]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.cache[index] if self.cache is not None else self._taps(index)

    @torch.no_grad()
    def _taps(self, index: int) -> torch.Tensor:
        tokens = self.sequences[index][0]
        # no logit rows: distillation reads the taps only, so the lm_head is not run
        no_rows = torch.zeros(1, 0, dtype=torch.long)
        _, aux, *_ = self.target(tokens[None], torch.zeros(1, dtype=torch.long), no_rows,
                                 *self.target.empty_cache(1, tokens.numel()))
        return aux[0]


def learning_rate(spec: DistillSpec, step: int) -> float:
    """Linear warm-up over ``--warmup`` steps, then a cosine from ``--lr`` down to a tenth of it at
    ``--steps``: a function of the step and ``--steps`` only, so a run resumed with the same
    ``--steps`` continues the same schedule."""
    warm = min(1.0, (step + 1) / spec.warmup) if spec.warmup else 1.0
    progress = min(1.0, step / spec.steps)
    return spec.lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def save(out: Path, draft: DraftStep, optimizer, step: int, losses: list[float], settings: dict) -> None:
    """``model.safetensors`` (fp16; ``d2t`` int64) in the native layout, then ``trainer.pt`` (the fp32
    trainable weights, the optimizer, the step), each replaced atomically. The embedding is the
    target's and is shared at load time (``docs/dspark.md#shared-and-ignored-tensors``); a reduced
    vocabulary keeps its own ``lm_head`` and ``d2t``."""
    reduced = draft.config.draft_vocab_size < draft.target_vocab_size
    dropped = {"embed_tokens.weight"} | (set() if reduced else {"lm_head.weight", "d2t"})
    tensors = {name: (t.half() if t.is_floating_point() else t.long()).contiguous()
               for name, t in draft.state_dict().items() if name not in dropped}
    _atomic(lambda tmp: write_tensors(tensors, tmp), out / "model.safetensors")
    weights = {name: p.detach().clone() for name, p in draft.named_parameters() if p.requires_grad}
    state = {"step": step, "losses": losses, "weights": weights, "optimizer": optimizer.state_dict(),
             "settings": settings}
    _atomic(lambda tmp: torch.save(state, tmp), out / "trainer.pt")


def _load_trainer(out: Path, settings: dict) -> dict | None:
    """``trainer.pt``'s state to resume from (None for a fresh run), refused when it was written
    with other data or another model."""
    path = out / "trainer.pt"
    if not path.is_file():
        return None
    trainer = torch.load(path)
    _check_same(trainer["settings"], settings, out)
    return trainer


def _check_same(saved: dict, current: dict, out: Path) -> None:
    for key, value in current.items():
        if key in saved and saved[key] != value:
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"--out {out} holds a run with {flag} {saved[key]}, not {value}; rerun "
                             f"with the same options to resume, or pass --force to start over")


def _atomic(write, path: Path) -> None:
    """``write(tmp)`` then rename over ``path``, so an interrupted save never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def measure_tau(target: TargetStep, out: Path, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Greedy acceptance (tokens per verify step) of the draft as saved in ``out``, loaded the way
    every consumer loads it."""
    from runtime.backend import capacity_needed
    from runtime.speculative import generate
    from runtime.torch_backend import TorchBackend

    draft = load_draft(out, target)
    capacity = capacity_needed(max(map(len, prompts)), max_new_tokens, k=draft.k,
                               block_size=draft.config.block_size)
    result = generate(TorchBackend(target, draft, capacity), prompts, max_new_tokens=max_new_tokens,
                      eos_token_ids=target.config.eos_token_ids)
    return result.stats.tau


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
    if result.tau is not None and not math.isnan(result.tau):
        lines.append(f"  tau {result.tau:.3f} tokens per verify step, greedy, on {eval_prompts} "
                     f"held-out prompts")
    return "\n".join(lines)
