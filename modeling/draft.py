"""``DraftStep``: one DSpark proposal — context K/V update, non-causal block forward, base logits,
and the Markov sampler unrolled ``k`` times — as one module with flat tensors in and out.

Semantics: ``docs/dspark.md`` (the block backbone, the Markov head, the reduced vocabulary).
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from torch import nn

from modeling.checkpoint import (
    CheckpointError,
    build_module,
    check_layer_count,
    read_tensor,
    resolve,
    stored_shape,
    stored_tensors,
)
from modeling.decoder import CachedStep, Rotary, softcap
from modeling.dense import TargetStep
from modeling.draft_config import DraftConfig, load_draft_config, resolve_k
from modeling.lazy_weights import DeferredWeights, hold_placeholders
from modeling.registry import DRAFTS
from modeling.target import embeddings_read_lazily, load_embeddings
from modeling.target_config import TargetConfig
from modeling.target_config_reader import load_target_config
from plugins.cache_write import cache_write
from plugins.d2t_gather import d2t_gather


class MarkovHead(nn.Module):
    """Low-rank logit bias ``markov_w2 @ markov_w1[prev]`` from the previous *target* token."""

    # ``build --weights`` leaves it float: ONNX Runtime fuses its product and the add of the base
    # logits into a Gemm before it can fuse a DequantizeLinear into the product, so a quantized
    # weight is de-quantized at every step, once per unrolled draft (docs/measurements.md, "The
    # demo pair with quantized weights"); and it is small (rank x V_d)
    keep_float = True

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)


class DraftStep(CachedStep, nn.Module):
    """Inputs:

    - ``ctx_aux [B, Sc, T*H_t]``: target aux rows verified since the last call (padded per row),
    - ``ctx_start [B]``: the draft cache's valid length, where those rows are written,
    - ``ctx_count [B]``: how many of the ``Sc`` rows are real; the anchor sits at
      ``p_anchor = ctx_start + ctx_count``,
    - ``anchor [B]``: the target's last emitted token (at ``p_anchor``),
    - ``temperature [B]`` (> 0) and ``noise [B, k, V_target]``: drafts are
      ``argmax(z / temperature + noise)``, each draft id taking the noise of its target id; zero
      noise gives greedy drafts, Gumbel noise samples (the target's own noise of the positions
      drafted: ``runtime/decoding/noise.py``),
    - per-layer caches ``k_0, v_0, k_1, ...`` each ``[B, Hkv, C, D]``.

    Outputs: ``tokens [B, k]`` (target ids), ``q [B, k, V_target]`` (the distribution each draft
    was drawn from, zero outside the draft vocabulary), the updated caches. Cache rows at and past
    ``p_anchor`` hold the block's scratch K/V; the next call's context rows overwrite them.
    """

    def __init__(self, config: DraftConfig, target_vocab_size: int, k: int, markov_top_k: int = 0):
        super().__init__()
        d = config.decoder
        self.config, self.k, self.markov_top_k = config, k, markov_top_k
        self.target_vocab_size = target_vocab_size
        taps = len(config.target_layer_ids)
        self.fc = nn.Linear(taps * config.target_hidden_size, d.hidden_size, bias=False)
        # the layers and the norms around them are the draft class's family's
        backbone = DRAFTS[config.architecture].backbone(config)
        self.embed_tokens, self.hidden_norm, self.layers, self.norm = backbone[:4]
        self.logit_softcap = backbone.logit_softcap
        self.lm_head = nn.Linear(d.hidden_size, config.draft_vocab_size, bias=False)
        self.markov_head = MarkovHead(config.vocab_size, config.draft_vocab_size, config.markov_rank)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.rotary = Rotary(d)

    def forward(self, ctx_aux, ctx_start, ctx_count, anchor, temperature, noise, *caches):
        caches = self.write_context(ctx_aux, ctx_start, *caches)
        base, *caches = self.block_logits(anchor, ctx_start + ctx_count, *caches)
        first = self.config.first_draft_row
        tokens, q = self.sample(base[:, first:first + self.k], anchor, temperature, noise)
        return tokens, q, *caches

    def write_context(self, ctx_aux, ctx_start, *caches):
        """``hidden_norm(fc(aux))`` -> each layer's ``k_proj``/``k_norm``/RoPE and ``v_proj``,
        written at rows ``ctx_start + i``. Context rows bypass the layers' ``input_layernorm``."""
        rows = ctx_aux.shape[1]
        positions = ctx_start[:, None] + torch.arange(rows, device=ctx_aux.device)
        context = self.context_input(ctx_aux)
        cos, sin = self.rotary.cos_sin(positions, context.dtype)
        new_caches = []
        for layer_index, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_value(context, cos, sin)
            new_caches += [cache_write(caches[2 * layer_index], k, ctx_start),
                           cache_write(caches[2 * layer_index + 1], v, ctx_start)]
        return new_caches

    def context_input(self, ctx_aux):
        """``hidden_norm(fc(ctx_aux))`` in ``fc``'s precision, fp32 even in an fp16 / bf16 draft
        (see ``keep_context_input_fp32``), then cast to the model dtype for the layers."""
        island = self.fc.weight.dtype
        return self.hidden_norm(self.fc(ctx_aux.to(island))).to(self.lm_head.weight.dtype)

    def precision(self) -> dict[str, torch.dtype]:
        """Which parts compute in which dtype, for the manifest."""
        return {"fc": self.fc.weight.dtype, "hidden_norm": self.hidden_norm.weight.dtype,
                "rest": self.lm_head.weight.dtype}

    def weight_units(self) -> list[nn.Module]:
        """The submodules that read their weights only when called: every linear layer and
        embedding but the Markov head's (``sample`` reads those as tensors). A build whose draft
        weights stay in the files gives each its own while it runs (``lazy_weights.resident``)."""
        markov = set(self.markov_head.modules())
        return [m for m in self.modules() if isinstance(m, (nn.Linear, nn.Embedding)) and m not in markov]

    def block_logits(self, anchor, anchor_pos, *caches):
        """Base logits ``[B, block_size, V_d]`` of the block ``[anchor, MASK, ...]`` at positions
        ``anchor_pos + j``, every block position attending to all context rows and to every other."""
        block = self.config.block_size
        masks = torch.full((anchor.shape[0], block - 1), self.config.mask_token_id,
                           dtype=anchor.dtype, device=anchor.device)
        ids = torch.cat([anchor[:, None], masks], dim=1)
        positions = anchor_pos[:, None] + torch.arange(block, device=anchor.device)
        h = self.embed_tokens(ids)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        new_caches = []
        for index, layer in enumerate(self.layers):
            h, k, v, *_ = layer(h, cos, sin, caches[2 * index], caches[2 * index + 1], anchor_pos,
                                causal=False)
            new_caches += [k, v]
        return self.logits(h), *new_caches

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Base logits of the last hidden rows (soft-capped where the backbone's are)."""
        return softcap(self.lm_head(self.norm(h)), self.logit_softcap)

    def sample(self, base, anchor, temperature, noise):
        """The Markov sampler, unrolled: row ``i`` adds the bias of its predecessor (the anchor,
        then the target id emitted at row ``i - 1``), is scaled by the temperature, and draws
        ``argmax(z + noise)`` (the noise of each draft id's target id); ``d2t`` maps the choice to
        a target id that feeds the next row.

        With ``markov_top_k`` K, row ``i``'s candidates are the K largest of its base logits (taken
        once for every row, ties to the lower id, as ONNX's TopK), and only they get the bias and
        can be drawn (vLLM's ``dspark_draft_topk``): the bias reads K rows of ``markov_w2`` instead
        of all of them, at 151936 ids and rank 256 a 39M-weight product a draft. ``q`` is then the
        distribution over those K that each draft was drawn from (what the confidence cut reads)."""
        w1 = self.markov_head.markov_w1.weight
        w2 = self.markov_head.markov_w2.weight
        batch = base.shape[0]
        target_ids = torch.arange(w2.shape[0], device=w2.device) + self.d2t
        target_columns = target_ids.expand(batch, -1)
        if w2.shape[0] != self.target_vocab_size:   # a reduced vocabulary: its ids' noise
            noise = noise[..., target_ids]
        row = w1[anchor]
        if self.markov_top_k:
            values, candidates = torch.topk(base, self.markov_top_k, dim=-1)   # [B, k, K]
            candidate_w2 = nn.functional.embedding(candidates, w2)             # [B, k, K, r]
        tokens, probs = [], []
        for i in range(self.k):
            if self.markov_top_k:
                bias = (candidate_w2[:, i] @ row[:, :, None])[..., 0]
                z_candidates = (values[:, i] + bias).float() / temperature[:, None]
                z = torch.full(base[:, i].shape, float("-inf"), dtype=torch.float32, device=base.device)
                z = z.scatter(1, candidates[:, i], z_candidates)
            else:
                z = (base[:, i] + row @ w2.T).float() / temperature[:, None]
            q = torch.zeros(batch, self.target_vocab_size, dtype=torch.float32, device=base.device)
            probs.append(q.scatter(1, target_columns, torch.softmax(z, dim=-1)))
            token, row = d2t_gather(z + noise[:, i], self.d2t, w1)
            tokens.append(token)
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)

    def training_logits(self, aux, tokens, anchors):
        """Training's forward (``python -m distill``): the logits ``[n, block_size, V_d]`` of every
        anchor's block at once, in one dense masked attention, as ``write_context`` +
        ``block_logits`` + the Markov bias compute them one anchor at a time, with the true tokens
        as Markov predecessors. ``aux [S, T*H]`` are the target's taps of ``tokens [S]``;
        ``anchors [n]`` are positions (each with a token after it)."""
        block, length, count = self.config.block_size, tokens.numel(), anchors.numel()
        span = anchors[:, None] + torch.arange(block)                      # [n, B] positions
        seen = int(anchors.max())                                          # context rows any block sees
        context = self.context_input(aux[None, :seen])
        ctx_cos, ctx_sin = self.rotary.cos_sin(torch.arange(seen)[None], context.dtype)
        ids = torch.full((count, block), self.config.mask_token_id, dtype=torch.long)
        ids[:, 0] = tokens[anchors]
        h = self.embed_tokens(ids.reshape(1, -1))
        cos, sin = self.rotary.cos_sin(span.reshape(1, -1), h.dtype)
        mask = _block_mask(anchors, seen, block)
        for layer in self.layers:
            context_kv = layer.self_attn.key_value(context, ctx_cos, ctx_sin)   # skips input_layernorm
            h = layer(h, cos, sin, context_kv=context_kv, mask=mask)[0]
        base = self.logits(h).reshape(count, block, -1)
        predecessors = tokens[span.clamp(max=length - 1)]                  # [anchor, y_1 .. y_{B-1}]
        return base + self.markov_head.markov_w2(self.markov_head.markov_w1(predecessors))


def _block_mask(anchors: torch.Tensor, seen: int, block: int) -> torch.Tensor:
    """``[n*B, seen + n*B]``: a row of anchor ``i``'s block sees the context rows ``< p_i`` and the
    ``B`` rows of its own block (non-causal), nothing of the other blocks."""
    owner = torch.arange(anchors.numel()).repeat_interleave(block)
    sees_context = torch.arange(seen)[None] < anchors.repeat_interleave(block)[:, None]
    return torch.cat([sees_context, owner[:, None] == owner[None]], dim=1)


def load_draft(path: str | Path, target: TargetStep | str | Path, k: int | None = None,
               dtype: torch.dtype = torch.float32, markov_top_k: int = 0) -> DraftStep:
    """Load a native or Speculators DSpark draft for ``target``: ``embed_tokens`` and ``lm_head``
    are shared from the target when the draft has none; ``t2d`` is ignored; the confidence head is
    not used for proposals (``docs/dspark.md#shared-and-ignored-tensors``).

    ``target`` is a loaded ``TargetStep``, or the target's checkpoint: then only its config is read,
    and its embeddings only if the draft shares them (``build`` exports one model at a time)."""
    return _load(path, target, k, dtype, markov_top_k, lazy=False)[0]


def load_draft_lazily(path: str | Path, target: str | Path, k: int | None = None,
                      dtype: torch.dtype = torch.float32,
                      markov_top_k: int = 0) -> tuple[DraftStep, DeferredWeights]:
    """``load_draft`` from the target's checkpoint, the module built holding
    ``lazy_weights.placeholder``s and its weights left in the files: the weights that read each
    (through what ``load_draft`` does to it) when asked. ``d2t`` is read now."""
    return _load(path, target, k, dtype, markov_top_k, lazy=True)


IGNORED = ("confidence_head.", "t2d")   # not used for proposals (``load_draft``)
VOCABULARY_ROWS = ("lm_head.weight", "markov_head.markov_w2.weight", "d2t")   # a row per draft id


def _load(path: str | Path, target: TargetStep | str | Path, k: int | None, dtype: torch.dtype,
          markov_top_k: int, lazy: bool) -> tuple[DraftStep, DeferredWeights | None]:
    directory = resolve(path, "draft")
    if isinstance(target, torch.nn.Module):
        tc: TargetConfig = target.config

        def shared() -> tuple[dict[str, torch.Tensor], DeferredWeights | None]:
            return {"embed_tokens.weight": target.embed_tokens.weight.detach(),
                    "lm_head.weight": target.lm_head.weight.detach()}, None
    else:
        target_dir = resolve(target, "target")
        tc = load_target_config(target_dir)

        def shared() -> tuple[dict[str, torch.Tensor], DeferredWeights | None]:
            return embeddings_read_lazily(target_dir) if lazy else (load_embeddings(target_dir), None)
    config = load_draft_config(directory, tc.decoder.num_layers, tc.decoder.hidden_size)
    k = resolve_k(config, k)
    ids = min(config.draft_vocab_size, tc.vocab_size)   # a padded draft vocabulary is cut to the target's
    if not 0 <= markov_top_k <= ids:
        raise ValueError(f"--markov-top-k {markov_top_k}: expected 0 (every draft id) .. the draft "
                         f"vocabulary's {ids} ids")
    stored = stored_tensors(directory, skip=IGNORED)
    readers = {name: partial(read_tensor, *where) for name, where in stored.items()}
    if lazy:   # meta tensors of the stored shapes; d2t's values, which the module keeps, now
        tensors = {name: torch.empty(stored_shape(*where), device="meta") for name, where in stored.items()}
        if "d2t" in stored:
            tensors["d2t"] = readers["d2t"]()
    else:
        tensors = {name: read() for name, read in readers.items()}
    where = f"{directory}/config.json"
    check_layer_count(tensors, config.decoder.num_layers, f"{where}: field 'num_hidden_layers'")

    owns_embeddings = {"embed_tokens.weight", "lm_head.weight"} <= tensors.keys()
    if config.decoder.hidden_size != tc.decoder.hidden_size and not owns_embeddings:
        raise CheckpointError(f"{where}: hidden_size {config.decoder.hidden_size} differs from the "
                              f"target's {tc.decoder.hidden_size}, so the draft must ship its own "
                              f"embed_tokens.weight and lm_head.weight")
    if config.vocab_size > tc.vocab_size and "embed_tokens.weight" not in tensors:
        raise CheckpointError(f"{where}: vocab_size {config.vocab_size} is larger than the target's "
                              f"{tc.vocab_size}; such a draft must include embed_tokens.weight")
    if config.vocab_size < tc.vocab_size:
        raise CheckpointError(f"{where}: vocab_size {config.vocab_size} is smaller than the target's "
                              f"{tc.vocab_size}; markov_w1 needs a row for every target token id")
    reduced = config.draft_vocab_size < tc.vocab_size
    if reduced and "lm_head.weight" not in tensors:
        raise CheckpointError(f"{directory}: reduced-vocabulary draft (draft_vocab_size "
                              f"{config.draft_vocab_size} < target vocab {tc.vocab_size}) must include "
                              f"lm_head.weight; the target's lm_head cannot be shared")
    if reduced and "d2t" not in tensors:
        raise CheckpointError(f"{directory}: reduced-vocabulary draft (draft_vocab_size "
                              f"{config.draft_vocab_size}) must include a d2t tensor mapping draft ids "
                              f"to target ids")
    fc = tensors.get("fc.weight")
    expected_fc = len(config.target_layer_ids) * config.target_hidden_size
    if fc is not None and (fc.ndim != 2 or fc.shape[1] != expected_fc):
        raise CheckpointError(f"{directory}: fc.weight has input width {list(fc.shape)[1:]} but "
                              f"{len(config.target_layer_ids)} taps x target hidden size "
                              f"{config.target_hidden_size} = {expected_fc} (config.json "
                              f"target_layer_ids / aux_hidden_state_layer_ids)")

    if not owns_embeddings:
        embeddings, their_weights = shared()
        for name, tensor in embeddings.items():
            if name not in tensors:
                tensors[name] = tensor
                if lazy:
                    readers[name] = partial(their_weights.load, name)
    if "d2t" in tensors:
        _check_d2t(tensors["d2t"], config.draft_vocab_size, tc.vocab_size, directory)
        tensors["d2t"] = tensors["d2t"].long()
    else:
        tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    # A padded draft vocabulary: ids past the target's can never be verified, so drop them.
    rows = tc.vocab_size if config.draft_vocab_size > tc.vocab_size else None
    config = replace(config, draft_vocab_size=min(config.draft_vocab_size, tc.vocab_size))
    scale = config.logit_scale

    def prepare(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """What the module holds of the stored ``tensor`` ``name``."""
        if rows is not None and name in VOCABULARY_ROWS:
            tensor = tensor[:rows]
        if scale != 1.0 and name in ("lm_head.weight", "markov_head.markov_w2.weight"):
            # as vLLM's logits processor: the base logits and the Markov bias; a new tensor (lm_head
            # may be shared)
            tensor = tensor.float() * scale
        return tensor

    tensors = {name: prepare(name, tensor) for name, tensor in tensors.items()}
    island = {name: tensors[name] for name in FP32_ISLAND}  # build_module consumes ``tensors``
    draft = build_module(lambda: DraftStep(config, tc.vocab_size, k, markov_top_k), tensors, directory, dtype)
    draft = keep_context_input_fp32(draft, island)
    if not lazy:
        return draft, None
    hold_placeholders(draft)
    buffers = {name: prepare(name, readers.pop(name)()).to(buffer.dtype)   # small tables (a layer's
               for name, buffer in draft.named_buffers() if buffer.is_meta}    # scalar): read now
    draft.load_state_dict(buffers, strict=False, assign=True)
    readers.pop("d2t", None)
    return draft, DeferredWeights(readers, prepare)


# The draft's context input, kept in fp32 whatever the model dtype: Qwen3's tap activations reach
# ~2e4, so the concatenated taps times ``fc`` overflow fp16 (TensorRT Edge-LLM accumulates its
# DSpark ``fc`` in fp32 for the same reason), and bf16 has the range but only 8 significant bits.
FP32_ISLAND = ("fc.weight", "hidden_norm.weight")


def keep_context_input_fp32(draft: DraftStep, tensors: dict[str, torch.Tensor]) -> DraftStep:
    """Give ``fc`` and ``hidden_norm`` their checkpoint ``tensors`` in fp32 (``build_module`` cast
    them to the model dtype); ``DraftStep.context_input`` then computes in fp32."""
    for name in FP32_ISLAND:
        module = draft.get_submodule(name.removesuffix(".weight"))
        module.weight = nn.Parameter(tensors[name].float(), requires_grad=False)
    return draft


def _check_d2t(d2t: torch.Tensor, draft_vocab: int, target_vocab: int, directory: Path) -> None:
    if d2t.dtype not in (torch.int64, torch.int32) or d2t.shape != (draft_vocab,):
        raise CheckpointError(f"{directory}: d2t must be an integer tensor of shape [{draft_vocab}] "
                              f"(offsets), got {d2t.dtype} {list(d2t.shape)}")
    mapped = torch.arange(draft_vocab) + d2t.long()
    if mapped.min() < 0 or mapped.max() >= target_vocab:
        raise CheckpointError(f"{directory}: d2t maps draft ids outside the target vocabulary "
                              f"[0, {target_vocab}) (d2t holds offsets: target = draft + d2t[draft])")

