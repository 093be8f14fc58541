"""Gemma 4 (``transformers``' ``modeling_gemma4.py``): the target step, and the layers its DSpark
draft (DeepSpec's ``Gemma4DSparkModel``) is made of.

What sets it apart from the Qwen3 decoder (``decoder.py``):

- sliding-window layers interleaved with full ones; a sliding layer's K/V cache is a ring of its
  window plus the rows a call may write (``plugins/block_attention/reference.py``), not
  ``max_seq_len`` rows;
- the full layers have their own head size and KV heads, a proportional partial RoPE with its own
  theta, and may take V from the raw K projection (``attention_k_eq_v``);
- q / k / v are RMS-normed per head (v without a scale) and the attention is unscaled (1.0);
- four norms per layer (each sublayer's input and output), then a per-layer ``layer_scalar``;
- optional per-layer input embeddings (PLE), added through a gated projection after each layer's
  MLP;
- the last ``num_kv_shared_layers`` layers have no K/V of their own: each attends to the caches of
  the last earlier layer of its type;
- a gelu-tanh MLP, ``x * w`` RMSNorms in fp32, the embedding scaled by ``sqrt(hidden)`` in the
  weights' dtype, and tanh soft-capped logits;
- with ``enable_moe_block`` (26B-A4B), routed gelu-tanh experts beside each layer's MLP, each
  branch normed before the two are added; the router norms the residual without a weight, scales
  it by ``scale`` and ``hidden^-0.5``, renormalises its top-k softmax weights and multiplies them
  by each chosen expert's ``per_expert_scale``.

Parameters are named as ``transformers`` names them, so checkpoints load as they are.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from modeling.checkpoint import CheckpointError, one_line
from modeling.decoder import (
    CONFIG_ERRORS,
    IGNORED_BACKBONE_FIELDS,
    LARGEST_DIMENSION,
    CachedStep,
    CacheSpec,
    DecoderConfig,
    DraftBackbone,
    Rotary,
    apply_rotary,
    check_fields,
    is_int,
    logits_and_aux,
    softcap,
)
from modeling.moe import Experts, MoeConfig
from plugins.block_attention import block_attention
from plugins.moe import ACTIVATIONS, moe_experts

SLIDING, FULL = "sliding_attention", "full_attention"
# the full layers' shape fields (transformers takes them as arguments, or in per_layer_config), and
# the MoE blocks'
FULL_LAYER_FIELDS = ("global_head_dim", "num_global_key_value_heads")
MOE_FIELDS = ("num_experts", "top_k_experts", "moe_intermediate_size")
SHAPE_FIELDS = FULL_LAYER_FIELDS + MOE_FIELDS
GELU_TANH = ACTIVATIONS.index("gelu_tanh")


@dataclass(frozen=True)
class Gemma4Layout:
    """What a Gemma 4 target adds to its ``DecoderConfig`` (which describes the sliding layers:
    their head size, KV heads and RoPE)."""
    layer_types: tuple[str, ...]
    sliding_window: int
    full_head_dim: int
    full_kv_heads: int
    attention_k_eq_v: bool               # full layers: V is the raw K projection
    kv_shared_layers: int                # the last layers that reuse an earlier layer's K/V
    double_wide_mlp: bool                # those layers' MLP is twice as wide
    per_layer_input_size: int            # PLE width (0: none)
    per_layer_vocab_size: int
    final_logit_softcapping: float | None
    full_rope_inv_freq: tuple[float, ...]
    full_rope_attention_scaling: float

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V ``layer`` attends to: itself, or for a shared layer the last
        non-shared layer of its type (``transformers``' ``kv_sharing_modes``)."""
        first_shared = len(self.layer_types) - self.kv_shared_layers
        if layer < first_shared:
            return layer
        kind = self.layer_types[layer]
        return max(i for i in range(first_shared) if self.layer_types[i] == kind)

    def cache_rows(self, layer: int, capacity: int, max_rows: int) -> int:
        """Rows of ``layer``'s K/V caches: ``capacity`` for a full layer; for a sliding one its
        window plus the rows a call may write past it (``max_rows``, the most rows per call),
        never more than ``capacity``."""
        if self.layer_types[layer] == FULL:
            return capacity
        return min(capacity, self.sliding_window + max_rows - 1)


class Gemma4RMSNorm(nn.Module):
    """``x / rms(x) * w`` in fp32, cast back last; ``scale`` False: no weight (v's norm)."""

    def __init__(self, size: int, eps: float, scale: bool = True):
        super().__init__()
        self.eps = eps
        if scale:
            self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if hasattr(self, "weight"):
            normed = normed * self.weight.float()
        return normed.type_as(x)


class ScaledEmbedding(nn.Embedding):
    """An embedding times ``scale``, the factor rounded to the weights' dtype first, as
    ``transformers`` rounds it (``sqrt(3840)`` is 62.0 in bf16)."""

    def __init__(self, rows: int, size: int, scale: float):
        super().__init__(rows, size)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * torch.tensor(self.scale, dtype=self.weight.dtype)


@dataclass(frozen=True)
class AttentionShape:
    """One layer's attention: heads, head size, RoPE, window (0: full), whether V is K's
    projection, and whether it owns K/V projections (a KV-shared layer has none)."""
    heads: int
    kv_heads: int
    head_dim: int
    window: int = 0
    k_eq_v: bool = False
    owns_kv: bool = True


class Gemma4Attention(nn.Module):
    def __init__(self, hidden: int, shape: AttentionShape, eps: float, bias: bool):
        super().__init__()
        self.shape = shape
        heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.q_norm = Gemma4RMSNorm(head_dim, eps)
        if shape.owns_kv:
            self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
            if not shape.k_eq_v:
                self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
            self.k_norm = Gemma4RMSNorm(head_dim, eps)
            self.v_norm = Gemma4RMSNorm(head_dim, eps, scale=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S, n*D]`` -> ``[B, n, S, D]``."""
        return x.unflatten(-1, (-1, self.shape.head_dim)).transpose(1, 2)

    def query(self, x, cos, sin):
        return apply_rotary(self.q_norm(self._heads(self.q_proj(x))), cos, sin)

    def key_value(self, x, cos, sin):
        """K (normed, rotated) and V (normed without a scale; the raw K projection where
        ``k_eq_v``) heads of ``x``: ``[B, Hkv, S, D]`` each."""
        k = self._heads(self.k_proj(x))
        v = k if self.shape.k_eq_v else self._heads(self.v_proj(x))
        return apply_rotary(self.k_norm(k), cos, sin), self.v_norm(v)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.transpose(1, 2).flatten(-2))


class Gemma4MLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, size, bias=False)
        self.up_proj = nn.Linear(hidden, size, bias=False)
        self.down_proj = nn.Linear(size, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma4Router(nn.Module):
    """``transformers``' ``Gemma4TextRouter``: each token's ``top_k`` experts and their weights."""

    def __init__(self, hidden: int, experts: int, eps: float):
        super().__init__()
        self.norm = Gemma4RMSNorm(hidden, eps, scale=False)
        self.proj = nn.Linear(hidden, experts, bias=False)
        self.proj.keep_float = True   # --weights leaves the router float (export/quantize.py)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(experts))

    def forward(self, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(self.norm(x) * self.scale * x.shape[-1] ** -0.5)
        weights, experts = scores.softmax(dim=-1, dtype=torch.float).topk(top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


class Gemma4Layer(nn.Module):
    """Norm -> attention -> norm, residual; norm -> MLP (beside the routed experts, with ``moe``)
    -> norm, residual; the PLE term; times ``layer_scalar``. The attention is ``block_attention``
    over the caches (causal, windowed in a sliding layer) or, in training, a masked attention over
    ``context_kv`` and the block."""

    def __init__(self, hidden: int, shape: AttentionShape, mlp_size: int, eps: float, bias: bool,
                 per_layer_input_size: int = 0, moe: MoeConfig | None = None):
        super().__init__()
        self.self_attn = Gemma4Attention(hidden, shape, eps, bias)
        self.mlp = Gemma4MLP(hidden, mlp_size)
        norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"]
        self.moe = moe
        if moe is not None:
            self.router = Gemma4Router(hidden, moe.num_experts, eps)
            self.experts = Experts(hidden, moe)
            norms += ["post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                      "post_feedforward_layernorm_2"]
        for name in norms:
            setattr(self, name, Gemma4RMSNorm(hidden, eps))
        self.register_buffer("layer_scalar", torch.ones(1))
        if per_layer_input_size:
            self.per_layer_input_gate = nn.Linear(hidden, per_layer_input_size, bias=False)
            self.per_layer_projection = nn.Linear(per_layer_input_size, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)

    def forward(self, h, cos, sin, k_cache=None, v_cache=None, start=None, causal: bool = False, *,
                shared_kv=None, per_layer_input=None, context_kv=None, mask=None):
        """``h [B, S, hidden]`` at cache rows ``start + i``; returns ``h``, the updated caches
        and this call's new K / V rows (for the layers that share them). ``shared_kv``: a shared
        layer's source rows ``(k, v)``, written again into the source's caches (the same values:
        the write keeps the graph's cache chain in place) before it attends."""
        x = self.input_layernorm(h)
        attn = self.self_attn
        q = attn.query(x, cos, sin)
        k, v = shared_kv if shared_kv is not None else attn.key_value(x, cos, sin)
        if mask is None:
            o, k_cache, v_cache = block_attention(q, k, v, k_cache, v_cache, start, causal=causal,
                                                  scale=1.0, window=attn.shape.window)
        else:
            o = F.scaled_dot_product_attention(q, torch.cat([context_kv[0], k], dim=2),
                                               torch.cat([context_kv[1], v], dim=2), attn_mask=mask,
                                               scale=1.0, enable_gqa=True)
        h = h + self.post_attention_layernorm(attn.output(o))
        h = h + self.post_feedforward_layernorm(self._feed_forward(h))
        if per_layer_input is not None:
            gated = F.gelu(self.per_layer_input_gate(h), approximate="tanh") * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar, k_cache, v_cache, (k, v)

    def _feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe is None:
            return mlp
        x = h.flatten(0, 1)
        weights, experts = self.router(x, self.moe.top_k)
        routed = moe_experts(self.pre_feedforward_layernorm_2(x), experts, weights.to(h.dtype),
                             self.experts.gate_up_proj, self.experts.down_proj, GELU_TANH)
        return (self.post_feedforward_layernorm_1(mlp)
                + self.post_feedforward_layernorm_2(routed.unflatten(0, h.shape[:2])))


class Gemma4TargetStep(CachedStep, nn.Module):
    """``dense.TargetStep``'s contract. The caches are those of the layers that own K/V
    (``k_l, v_l`` in layer order, none for a KV-shared layer): ``[B, Hkv, C, D]`` for a full layer,
    ``[B, Hkv, R, D]`` for a sliding one, ``R = Gemma4Layout.cache_rows`` (a ring)."""

    def __init__(self, config, taps: Sequence[int] = ()):
        super().__init__()
        d, g = config.decoder, config.gemma4
        self.config = config
        self.taps = tuple(sorted(taps))
        self.embed_tokens = ScaledEmbedding(config.vocab_size, d.hidden_size, d.hidden_size ** 0.5)
        self.layers = nn.ModuleList(
            Gemma4Layer(d.hidden_size, attention_shape(d, g, i), mlp_size(d, g, i), d.rms_norm_eps,
                        d.attention_bias, g.per_layer_input_size, config.moe) for i in range(d.num_layers))
        self.norm = Gemma4RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.lm_head = nn.Linear(d.hidden_size, config.vocab_size, bias=False)
        self.rotary = nn.ModuleDict({SLIDING: Rotary(d), FULL: Rotary(replace(
            d, rope_inv_freq=g.full_rope_inv_freq, rope_attention_scaling=g.full_rope_attention_scaling))})
        if g.per_layer_input_size:
            width = d.num_layers * g.per_layer_input_size
            self.embed_tokens_per_layer = ScaledEmbedding(g.per_layer_vocab_size, width,
                                                          g.per_layer_input_size ** 0.5)
            self.per_layer_model_projection = nn.Linear(d.hidden_size, width, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(g.per_layer_input_size, d.rms_norm_eps)

    def owners(self) -> list[int]:
        """The layers that own K/V caches, in the graphs' order."""
        g = self.config.gemma4
        return [i for i in range(len(self.layers)) if g.kv_source(i) == i]

    def forward(self, input_ids, start, logit_rows, *caches):
        g = self.config.gemma4
        positions = start[:, None] + torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.embed_tokens(input_ids)
        rotations = {kind: rotary.cos_sin(positions, h.dtype) for kind, rotary in self.rotary.items()}
        per_layer = self._per_layer_inputs(input_ids, h) if g.per_layer_input_size else None
        slot = {layer: 2 * n for n, layer in enumerate(self.owners())}
        caches, rows = list(caches), {}
        aux = [h] if -1 in self.taps else []
        for index, layer in enumerate(self.layers):
            source = g.kv_source(index)
            at = slot[source]
            h, caches[at], caches[at + 1], rows[index] = layer(
                h, *rotations[g.layer_types[index]], caches[at], caches[at + 1], start, causal=True,
                shared_kv=rows[source] if source != index else None,
                per_layer_input=None if per_layer is None else per_layer[:, :, index])
            if index in self.taps:
                aux.append(h)
        logits, aux = logits_and_aux(h, aux, logit_rows, self.norm, self.lm_head)
        return softcap(logits, g.final_logit_softcapping), aux, *caches

    def _per_layer_inputs(self, input_ids, h):
        """PLE: each layer's ``[B, S, P]`` input, the token's own per-layer embedding and a
        projection of its embedding, normed, summed and scaled by ``2^-0.5``."""
        size = self.config.gemma4.per_layer_input_size
        tokens = self.embed_tokens_per_layer(input_ids).unflatten(-1, (-1, size))
        projected = self.per_layer_model_projection(h) * torch.tensor(
            h.shape[-1] ** -0.5, dtype=h.dtype)
        projected = self.per_layer_projection_norm(projected.unflatten(-1, (-1, size)))
        return (projected + tokens) * torch.tensor(2.0 ** -0.5, dtype=h.dtype)

    rings = True

    def cache_specs(self, batch, capacity: int, slots: int = 1,
                    max_rows: int | None = None) -> list[CacheSpec]:
        """K / V of each layer that owns them: ``[B, Hkv, C, D]`` for a full layer, a ring of
        ``Gemma4Layout.cache_rows`` rows for a sliding one."""
        return cache_specs(self.config, batch, capacity, max_rows or capacity, self.lm_head.weight.dtype)


def attention_shape(d: DecoderConfig, g: Gemma4Layout, layer: int) -> AttentionShape:
    owns = g.kv_source(layer) == layer
    if g.layer_types[layer] == SLIDING:
        return AttentionShape(d.num_heads, d.num_kv_heads, d.head_dim, window=g.sliding_window,
                              owns_kv=owns)
    return AttentionShape(d.num_heads, g.full_kv_heads, g.full_head_dim, k_eq_v=g.attention_k_eq_v,
                          owns_kv=owns)


def mlp_size(d: DecoderConfig, g: Gemma4Layout, layer: int) -> int:
    shared = g.kv_source(layer) != layer
    return d.intermediate_size * (2 if g.double_wide_mlp and shared else 1)


def cache_specs(config, batch, capacity: int, max_rows: int, dtype: torch.dtype) -> list[CacheSpec]:
    """``Gemma4TargetStep.cache_specs`` of a config: ``k, v`` of each layer that owns them."""
    d, g = config.decoder, config.gemma4
    specs = []
    for layer in range(d.num_layers):
        if g.kv_source(layer) == layer:
            shape = attention_shape(d, g, layer)
            rows = g.cache_rows(layer, capacity, max_rows)
            specs += [CacheSpec(kind, layer, (batch, shape.kv_heads, rows, shape.head_dim), dtype)
                      for kind in ("k", "v")]
    return specs


def layout_from_hf(hf, draft: bool = False) -> tuple[DecoderConfig, Gemma4Layout]:
    """A ``transformers`` ``Gemma4TextConfig`` (or ``Gemma4UnifiedTextConfig``) -> the sliding
    layers' ``DecoderConfig`` (the full ones' where there is no sliding layer) and the rest.
    ``ValueError`` names the first field the engine cannot follow.

    ``draft``: the config of a DSpark draft (DeepSpec's ``Gemma4DSparkModel``, a copy of its
    target's text config with every layer full attention), which never decodes on its own and
    shares no K/V: ``num_kv_shared_layers`` only widens the MLPs, as ``transformers`` 5.10's
    ``Gemma4TextMLP`` (which DeepSpec builds) does from the first shared layer on, none when that
    would be layer 0."""
    if not draft and hf.use_bidirectional_attention == "all":
        raise ValueError("field 'use_bidirectional_attention' = 'all': a bidirectional decoder cannot "
                         "decode; expected null or 'vision'")
    if hf.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(f"field 'hidden_activation' = {hf.hidden_activation!r}: expected "
                         f"'gelu_pytorch_tanh'")
    layers = hf.num_hidden_layers
    types = tuple(hf.layer_types)
    if len(types) != layers or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"field 'layer_types' = {list(types)}: expected {layers} entries (one per "
                         f"layer), each {SLIDING!r} or {FULL!r}")
    shared = hf.num_kv_shared_layers
    if draft and is_int(shared) and shared >= 0:
        shared = shared if shared < layers else 0
    if not (is_int(shared) and 0 <= shared < layers) or (
            shared and set(types[layers - shared:]) - set(types[:layers - shared])):
        raise ValueError(f"field 'num_kv_shared_layers' = {shared!r}: expected 0 .. {layers - 1}, "
                         f"leaving a layer of each shared type before the shared ones")
    # the unified form (12B) has no per-layer inputs at all; a draft has no sliding layers
    for name, low in ((("sliding_window", 1),) if not draft else ()) + (("hidden_size_per_layer_input", 0),):
        value = getattr(hf, name, 0)
        if not (is_int(value) and low <= value <= 1 << 24):
            raise ValueError(f"field '{name}' = {value!r}: expected an integer >= {low}")
    ple = getattr(hf, "hidden_size_per_layer_input", 0) or 0
    if ple and hf.vocab_size_per_layer_input < hf.vocab_size:
        raise ValueError(f"field 'vocab_size_per_layer_input' = {hf.vocab_size_per_layer_input!r}: "
                         f"expected at least vocab_size ({hf.vocab_size}), a per-layer row for every token")
    cap = hf.final_logit_softcapping
    if cap is not None and not (isinstance(cap, (int, float)) and cap > 0 and math.isfinite(cap)):
        raise ValueError(f"field 'final_logit_softcapping' = {cap!r}: expected a number > 0 or null")
    frequencies = rope_frequencies(hf, set(types))
    sliding = next(i for i, t in enumerate(types) if t == SLIDING) if SLIDING in types else None
    full = types.index(FULL) if FULL in types else None
    sliding_config = hf.per_layer_config[sliding if sliding is not None else full]
    full_config = hf.per_layer_config[full if full is not None else sliding]
    for field, layer in (("num_key_value_heads", sliding_config),
                         ("num_global_key_value_heads", full_config)):
        if hf.num_attention_heads % layer.num_key_value_heads:
            raise ValueError(f"field '{field}' = {layer.num_key_value_heads}: expected a divisor of "
                             f"num_attention_heads ({hf.num_attention_heads})")
    sliding_freq, sliding_scaling = frequencies.get(SLIDING) or frequencies[FULL]
    full_freq, full_scaling = frequencies.get(FULL) or frequencies[SLIDING]
    decoder = DecoderConfig(
        hidden_size=hf.hidden_size, num_layers=layers, num_heads=hf.num_attention_heads,
        num_kv_heads=sliding_config.num_key_value_heads, head_dim=sliding_config.head_dim,
        intermediate_size=hf.intermediate_size, rms_norm_eps=hf.rms_norm_eps,
        attention_bias=bool(hf.attention_bias), mlp_bias=False, qk_norm=True,
        rope_inv_freq=sliding_freq, rope_attention_scaling=sliding_scaling)
    layout = Gemma4Layout(
        layer_types=types, sliding_window=hf.sliding_window, full_head_dim=full_config.head_dim,
        full_kv_heads=full_config.num_key_value_heads, attention_k_eq_v=bool(hf.attention_k_eq_v),
        kv_shared_layers=shared, double_wide_mlp=bool(hf.use_double_wide_mlp),
        per_layer_input_size=ple, per_layer_vocab_size=hf.vocab_size_per_layer_input if ple else 0,
        final_logit_softcapping=None if cap is None else float(cap),
        full_rope_inv_freq=full_freq, full_rope_attention_scaling=full_scaling)
    return decoder, layout


def moe_from_hf(hf) -> MoeConfig | None:
    """``enable_moe_block``'s experts (26B-A4B: 128, top 8), in every layer; None without."""
    if not getattr(hf, "enable_moe_block", False):   # the unified form (12B) has no such field
        return None
    experts, top_k = hf.num_experts, hf.top_k_experts
    for name in MOE_FIELDS:
        if not (is_int(getattr(hf, name)) and getattr(hf, name) >= 1):
            raise ValueError(f"field '{name}' = {getattr(hf, name)!r}: expected an integer >= 1 "
                             f"(enable_moe_block is true)")
    if top_k > experts:
        raise ValueError(f"field 'top_k_experts' = {top_k}: expected 1 .. num_experts ({experts})")
    return MoeConfig(num_experts=experts, top_k=top_k, expert_size=hf.moe_intermediate_size,
                     normalize=True, shared_size=0, sparse_layers=(True,) * hf.num_hidden_layers)


def rope_frequencies(hf, kinds: set[str]) -> dict[str, tuple[tuple[float, ...], float]]:
    """Each layer type's RoPE inverse frequencies and cos / sin scaling, as ``transformers``
    computes them (``Gemma4TextRotaryEmbedding``), once ``rope_parameters`` is checked for what
    it would take and run wrong with: ``ValueError`` names the field."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    from modeling.decoder import is_positive_number

    for kind in sorted(kinds):
        params = (hf.rope_parameters or {}).get(kind)
        field = f"field 'rope_parameters.{kind}"
        if not isinstance(params, dict):
            raise ValueError(f"{field}' = {params!r}: expected an object (the {kind} layers' RoPE)")
        theta, factor = params.get("rope_theta"), params.get("partial_rotary_factor", 1.0)
        rope_type = params.get("rope_type", "default")
        if not is_positive_number(theta):
            raise ValueError(f"{field}.rope_theta' = {theta!r}: expected a number > 0")
        if not (is_positive_number(factor) and factor <= 1):
            raise ValueError(f"{field}.partial_rotary_factor' = {factor!r}: expected a number in (0, 1]")
        if rope_type == "dynamic" or not (rope_type == "default" or rope_type in ROPE_INIT_FUNCTIONS):
            raise ValueError(f"{field}.rope_type' = {rope_type!r}: expected default, proportional or "
                             f"another fixed scaling of {sorted(set(ROPE_INIT_FUNCTIONS) - {'dynamic'})}")
    rotary = Gemma4TextRotaryEmbedding(hf)
    return {kind: (tuple(getattr(rotary, f"{kind}_inv_freq").tolist()),
                   float(getattr(rotary, f"{kind}_attention_scaling"))) for kind in kinds}


def check_unused(left: dict[str, torch.Tensor], config, directory) -> None:
    """``Family.check_unused``: a Gemma 4 checkpoint's tensors that the module its config.json
    describes does not hold, beyond the K / V projections and norms of KV-shared layers (which
    ``transformers`` ignores too): the weights of a per-layer input, a V projection or a layer the
    config turned off, which would otherwise be dropped without a word."""
    layout = config.gemma4
    ignored = tuple(f"layers.{i}.self_attn.{part}." for i in range(len(layout.layer_types))
                    if layout.kv_source(i) != i for part in ("k_proj", "v_proj", "k_norm", "v_norm"))
    # a multimodal checkpoint's other parts keep their prefix: only the text model's are checked
    unused = sorted(name for name in left if not name.startswith((*ignored, "model.")))
    if unused:
        shown = ", ".join(unused[:3]) + (f" (+{len(unused) - 3} more)" if len(unused) > 3 else "")
        raise CheckpointError(f"{directory}: tensor(s) {shown} are not part of the model config.json "
                              f"describes (a field such as hidden_size_per_layer_input, attention_k_eq_v "
                              f"or num_kv_shared_layers disagrees with the weights)")


@dataclass(frozen=True)
class Gemma4Draft:
    """What a Gemma 4 draft (DeepSpec's ``Gemma4DSparkModel``) adds to its ``DecoderConfig``,
    which holds its full-attention head size, KV heads and proportional RoPE: V taken from the
    raw K projection, soft-capped logits, and each layer's MLP width (the manifest's
    ``draft.gemma4``)."""
    attention_k_eq_v: bool
    final_logit_softcapping: float | None
    mlp_sizes: tuple[int, ...]


def read_draft(raw: dict, path: Path, field: str = "") -> tuple[DecoderConfig, int, int, dict]:
    """A ``Gemma4DSparkModel``'s backbone, as DeepSpec builds it from the config (a copy of the
    target's text config): every layer full attention of ``global_head_dim``, KV heads
    ``num_global_key_value_heads`` where K is V, RoPE as the target's full layers. Returns its
    decoder, vocabulary size, max_position_embeddings and ``{"gemma4": Gemma4Draft}``."""
    from transformers import AutoConfig

    model_type = raw.get("model_type")
    if model_type not in ("gemma4_text", "gemma4_unified_text"):   # a copy of its target's text config
        raise CheckpointError(f"{path}: field '{field}model_type' = {model_type!r}: expected 'gemma4_text' "
                              f"or 'gemma4_unified_text' for Gemma4DSparkModel")
    # absent, transformers 5.10 (which DeepSpec builds it with) assumes per-layer inputs of 256
    for name, off, default in (("hidden_size_per_layer_input", 0, 256), ("enable_moe_block", False, False)):
        value = raw.get(name, default)
        if value != off or isinstance(value, bool) != isinstance(off, bool):
            raise CheckpointError(f"{path}: field '{field}{name}' = {value!r}: DeepSpec's Gemma4DSparkModel "
                                  f"has no per-layer inputs or MoE blocks; expected {json.dumps(off)}")
    layers = raw.get("num_hidden_layers")
    if not (is_int(layers) and 1 <= layers <= LARGEST_DIMENSION):
        raise CheckpointError(f"{path}: field '{field}num_hidden_layers' = {layers!r}: expected an integer "
                              f"from 1 to {LARGEST_DIMENSION}")
    if raw.get("layer_types") != [FULL] * layers:
        raise CheckpointError(f"{path}: field '{field}layer_types' = {raw.get('layer_types')!r}: expected "
                              f"'{FULL}' for each of the {layers} draft layers")
    if raw.get("attention_k_eq_v") and not is_int(raw.get("num_global_key_value_heads")):
        raise CheckpointError(f"{path}: field '{field}num_global_key_value_heads' = "
                              f"{raw.get('num_global_key_value_heads')!r}: expected an integer "
                              f"(attention_k_eq_v is true)")
    clean = {k: v for k, v in raw.items() if k not in IGNORED_BACKBONE_FIELDS}
    try:
        check_fields(clean, model_type, FULL_LAYER_FIELDS)
        hf = AutoConfig.for_model(model_type, **clean)
        decoder, layout = layout_from_hf(hf, draft=True)
    except CONFIG_ERRORS as err:
        raise CheckpointError(f"{path}: {one_line(err)}") from None
    draft = Gemma4Draft(attention_k_eq_v=layout.attention_k_eq_v,
                        final_logit_softcapping=layout.final_logit_softcapping,
                        mlp_sizes=tuple(mlp_size(decoder, layout, i) for i in range(layers)))
    return decoder, hf.vocab_size, hf.max_position_embeddings, {"gemma4": draft}


def draft_backbone(config) -> DraftBackbone:
    """The modules of a draft with ``config`` (a ``DraftConfig`` read by ``read_draft``): Gemma 4
    layers, all full attention, and soft-capped logits."""
    d, g = config.decoder, config.gemma4
    shape = AttentionShape(d.num_heads, d.num_kv_heads, d.head_dim, k_eq_v=g.attention_k_eq_v)
    return DraftBackbone(
        ScaledEmbedding(config.vocab_size, d.hidden_size, d.hidden_size ** 0.5),
        Gemma4RMSNorm(d.hidden_size, d.rms_norm_eps),
        nn.ModuleList(Gemma4Layer(d.hidden_size, shape, size, d.rms_norm_eps, d.attention_bias)
                      for size in g.mlp_sizes),
        Gemma4RMSNorm(d.hidden_size, d.rms_norm_eps), g.final_logit_softcapping)
