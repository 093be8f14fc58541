"""The pre-norm Llama / Qwen3 decoder layer shared by the target and the DSpark draft.

Parameter names follow the Hugging Face checkpoints (``self_attn.q_proj``, ``mlp.gate_proj``, ...)
so that a checkpoint's tensors load with ``load_state_dict`` and nothing is renamed by hand.
The attention pattern is ``plugins.block_attention``: causal for the target, non-causal for the
draft block over its context K/V.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from plugins.block_attention import block_attention

try:  # transformers 5 validates configs as huggingface_hub strict dataclasses
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # an earlier huggingface_hub has none; transformers 4 raises the built-in errors
    StrictDataclassError = ValueError

# What transformers raises on a config.json it cannot read (a field of the wrong type or value)
CONFIG_ERRORS = (ValueError, KeyError, TypeError, AttributeError, IndexError, StrictDataclassError)
# Fields that fix tensor shapes. transformers fills a missing one with its class default (Qwen3:
# hidden_size 4096, head_dim 128), which says nothing about the checkpoint, so it must be stated;
# only where that default is None does transformers derive it (Llama: head_dim = hidden_size /
# heads, as many KV heads as heads).
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim")
# Far above any released model's widths, and refused before a tensor of that size is allocated
LARGEST_DIMENSION = 1 << 24
# a draft config's backbone fields not handed to transformers: the precision is --dtype's, the
# model type is checked
IGNORED_BACKBONE_FIELDS = ("model_type", "architectures", "dtype", "torch_dtype")


def is_int(value) -> bool:
    """A JSON integer (``true`` is not one, although Python's ``bool`` is an ``int``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_number(value) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


def check_fields(raw: dict, model_type: str, extra: tuple[str, ...] = ()) -> None:
    """``ValueError`` naming the first field of ``raw`` (a Llama / Qwen3 config) that transformers
    would take but the engine cannot: a shape field (``SHAPE_FIELDS`` and the family's ``extra``)
    left out where transformers would assume a number, or anything but an integer in
    1..``LARGEST_DIMENSION``; a max_position_embeddings below 1."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    defaults = inspect.signature(config_class).parameters
    for name in (*SHAPE_FIELDS, *extra):
        # a field may be stored under the name transformers maps it to (Qwen3-MoE's num_experts is
        # written as num_local_experts)
        stored = config_class.attribute_map.get(name)
        field = stored if name not in raw and stored in raw else name
        if name not in defaults and field not in raw:
            # not a field of the family's config class: transformers derives it when absent
            # (Qwen3-MoE's head_dim) or never reads it (Qwen3.5-MoE has no dense MLP); given, it
            # is taken as it is, and null as absent (a Gemma 4 config saved by transformers 5.10.2
            # writes num_global_key_value_heads null: no override of the full layers' kv heads)
            continue
        derived = name not in defaults or defaults[name].default is None
        if field not in raw and not derived:
            raise ValueError(f"missing field '{name}' (it fixes tensor shapes; expected an integer)")
        value = raw.get(field)
        if not (value is None and derived) and not (is_int(value) and 1 <= value <= LARGEST_DIMENSION):
            raise ValueError(f"field '{field}' = {value!r}: expected an integer from 1 to "
                             f"{LARGEST_DIMENSION}")
    positions = raw.get("max_position_embeddings", 1)
    if not is_int(positions) or positions < 1:
        raise ValueError(f"field 'max_position_embeddings' = {positions!r}: expected an integer >= 1")


@dataclass(frozen=True)
class DecoderConfig:
    """Shapes and numerics of a decoder stack; RoPE is resolved to numbers at load time so that
    nothing downstream needs the checkpoint's ``transformers`` config."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3 normalises q and k per head; Llama does not
    rope_inv_freq: tuple[float, ...]   # rotary width / 2 (head_dim / 2 unless partial)
    rope_attention_scaling: float

    @classmethod
    def from_hf(cls, config, *, qk_norm: bool, num_layers: int | None = None,
                partial_rotary: bool = False) -> "DecoderConfig":
        """Read a ``transformers`` Llama/Qwen3 config (``PretrainedConfig``); ``partial_rotary``:
        the family rotates only ``rope_parameters.partial_rotary_factor`` of each head (Qwen3.5)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
        if partial_rotary and not (is_positive_number(factor) and factor <= 1):
            raise ValueError(f"field 'rope_parameters.partial_rotary_factor' = {factor!r}: expected a "
                             f"number in (0, 1]")
        inv_freq, scaling = rope_parameters(config, int(head_dim * factor) if partial_rotary else head_dim)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (expected 'silu')")
        kv_heads = config.num_key_value_heads or config.num_attention_heads
        if config.num_attention_heads % kv_heads:
            raise ValueError(f"field 'num_key_value_heads' = {kv_heads}: expected a divisor of "
                             f"num_attention_heads ({config.num_attention_heads})")
        if not is_positive_number(config.rms_norm_eps):
            raise ValueError(f"field 'rms_norm_eps' = {config.rms_norm_eps!r}: expected a number > 0")
        return cls(
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers if num_layers is None else num_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            # a model whose every layer is a MoE block (Qwen3.5-MoE) has no dense MLP: its experts' width
            intermediate_size=getattr(config, "intermediate_size", None) or config.moe_intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=qk_norm,
            rope_inv_freq=tuple(inv_freq.tolist()),
            rope_attention_scaling=float(scaling),
        )


def rope_parameters(config, width: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies over the rotated ``width`` of a head and the cos/sin scaling for the
    config's RoPE type, computed by ``transformers`` itself for every scaled type (linear, yarn,
    llama3, longrope, ...; they read a partial rotary factor from the config themselves)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if not is_positive_number(base):
        raise ValueError(f"field 'rope_parameters.rope_theta' = {base!r}: expected a number > 0")
    if rope_type == "default":
        # float32 exactly as transformers computes it, so positions far out rotate identically
        return 1.0 / (base ** (torch.arange(0, width, 2, dtype=torch.int64).float() / width)), 1.0
    if rope_type == "dynamic":
        raise ValueError("rope_type 'dynamic' changes the frequencies with the sequence length, "
                         "which a fixed engine cannot follow; not supported")
    if not isinstance(rope_type, str) or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {rope_type!r} is not supported "
                         f"(expected default or one of {sorted(ROPE_INIT_FUNCTIONS)})")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq, scaling


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, accumulated in fp32 whatever the model dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalized(x, self.eps).to(x.dtype)


def rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` in fp32 whatever ``x``'s dtype: what every RMS norm here
    scales, each by its own weights."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class Rotary(nn.Module):
    """Neox-style (rotate-half) rotary embedding at absolute positions."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        # A buffer, so that it moves with the module and a step never copies it from the host (a
        # host-to-device copy cannot be captured in a CUDA graph). Not persistent: checkpoints never
        # carry it. Made on the CPU even while the module is built on the meta device
        # (``checkpoint.build_module``), since no checkpoint tensor will replace it.
        self.register_buffer("inv_freq", torch.tensor(config.rope_inv_freq, dtype=torch.float32,
                                                      device="cpu"), persistent=False)
        self.scaling = config.rope_attention_scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [B, S]`` -> cos, sin ``[B, 1, S, head_dim]`` for broadcasting over heads."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        return cos[:, None].to(dtype), sin[:, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """The projections of one attention layer; the attention pattern is the caller's."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:
        """``[B, S, count*D]`` -> ``[B, count, S, D]``."""
        return x.unflatten(-1, (count, self.head_dim)).transpose(1, 2)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self._heads(self.q_proj(x), self.num_heads)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
        return apply_rotary(q, cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """K (normed, rotated) and V (neither) heads of ``x``: ``[B, Hkv, S, D]`` each."""
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        if hasattr(self, "k_norm"):
            k = self.k_norm(k)
        return apply_rotary(k, cos, sin), self._heads(self.v_proj(x), self.num_kv_heads)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """``[B, H, S, D]`` attention output -> ``[B, S, hidden]``."""
        return self.o_proj(o.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual layer whose attention is ``block_attention`` over a fixed-capacity cache:
    causal for the target, non-causal for the draft block."""

    def __init__(self, config: DecoderConfig, mlp: nn.Module | None = None):
        """``mlp``: the feed-forward block, when it is not the SwiGLU ``MLP`` (a MoE block)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(config)

    def forward(self, h, cos, sin, k_cache=None, v_cache=None, start=None, causal: bool = False, *,
                context_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                mask: torch.Tensor | None = None):
        """``h [B, S, hidden]`` at cache rows ``start + i``; returns ``h`` and the updated caches.

        Training (``mask`` given, as distillation runs the draft): no caches; the block attends to
        ``context_kv`` (K/V ``[B, Hkv, C, D]`` of rows before it) and itself through ``mask
        [S, C + S]``, every anchor's block in one call; the caches come back as None."""
        x = self.input_layernorm(h)
        attn = self.self_attn
        q, (k, v) = attn.query(x, cos, sin), attn.key_value(x, cos, sin)
        if mask is None:
            o, k_cache, v_cache = block_attention(q, k, v, k_cache, v_cache, start, causal=causal,
                                                  scale=attn.scale)
        else:
            o = F.scaled_dot_product_attention(q, torch.cat([context_kv[0], k], dim=2),
                                               torch.cat([context_kv[1], v], dim=2), attn_mask=mask,
                                               scale=attn.scale, enable_gqa=True)
        h = h + attn.output(o)
        return h + self.mlp(self.post_attention_layernorm(h)), k_cache, v_cache


def embedded(step: nn.Module, input_ids: torch.Tensor, start: torch.Tensor):
    """How a target step's forward opens: the rows' embeddings ``h`` (``step.embed_tokens``), the
    rotary ``cos`` / ``sin`` at their positions ``start ..``, and the taps list, which holds ``h``
    where the draft taps the embeddings (-1 in ``step.taps``)."""
    positions = start[:, None] + torch.arange(input_ids.shape[1], device=input_ids.device)
    h = step.embed_tokens(input_ids)
    cos, sin = step.rotary.cos_sin(positions, h.dtype)
    return h, cos, sin, [h] if -1 in step.taps else []


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``tanh(logits / cap) * cap`` (``final_logit_softcapping``), in the logits' dtype."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


class DraftBackbone(NamedTuple):
    """A DSpark draft's modules between ``fc`` and ``lm_head``, as its backbone's family makes them
    (the registry's ``DRAFTS``); ``modeling/draft.py`` keeps them under DeepSpec's names."""
    embed_tokens: nn.Module
    hidden_norm: nn.Module          # the context rows' norm after ``fc``
    layers: nn.ModuleList
    norm: nn.Module
    logit_softcap: float | None = None


def logits_and_aux(h: torch.Tensor, taps: list[torch.Tensor], logit_rows: torch.Tensor, norm: nn.Module,
                   lm_head: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """A target step's outputs from the last hidden rows ``h [B, S, hidden]`` and the tapped ones:
    ``logits [B, L, V]`` of the ``logit_rows`` only (picked before the norm and ``lm_head``, so a
    prefill chunk computes one row of a 152k vocabulary, not 512), and ``aux [B, S, T * hidden]``."""
    aux = torch.cat(taps, dim=-1) if taps else h.new_zeros(*h.shape[:2], 0)
    picked = h.gather(1, logit_rows[..., None].expand(-1, -1, h.shape[-1]))
    # 2-D: exports as one Gemm(transB=1) that reads the weight as it is stored; a 3-D linear
    # exports as MatMul(x, Transpose(W)), which the optimizer folds into a transposed copy of W, a
    # second copy of a tied embedding
    logits = lm_head(norm(picked).flatten(0, 1))
    return logits.unflatten(0, logit_rows.shape), aux


@dataclass(frozen=True)
class CacheSpec:
    """One cache tensor of a step, in the graphs' order: ``{kind}_cache{suffix}_{layer}`` (suffix
    ``_out`` for the updated one), its shape (ints, or an axis name in a graph) and dtype. One tensor
    per layer and kind, so that a runtime can bind each as both input and output and every write
    lands in place."""
    kind: str
    layer: int
    shape: tuple
    dtype: torch.dtype

    def name(self, suffix: str = "") -> str:
        return f"{self.kind}_cache{suffix}_{self.layer}"


def kv_cache_specs(config: DecoderConfig, batch, capacity: int, dtype: torch.dtype,
                   layers=None) -> list[CacheSpec]:
    """K / V ``[B, Hkv, C, D]`` of each of ``layers`` (all by default): ``k_0, v_0, k_1, ...``."""
    shape = (batch, config.num_kv_heads, capacity, config.head_dim)
    return [CacheSpec(kind, layer, shape, dtype)
            for layer in (range(config.num_layers) if layers is None else layers) for kind in ("k", "v")]


class CachedStep:
    """What every step module (target or draft) offers its runtimes: ``cache_specs(batch, capacity,
    slots, max_rows)``, its caches in the graphs' order, and ``empty_cache``, them zeroed; one
    signature for every family. ``slots``: a hybrid's recurrent-state slots (the verify block's
    rows); ``max_rows``: the most rows one call writes (a sliding ring's slack; None: ``capacity``,
    caches that never wrap). A family takes what it needs of them; ``takes_states``: whether its
    graph also takes ``state_slot`` and ``state_rows``; ``rings``: whether some caches keep only
    their last rows (sliding windows)."""
    takes_states = False
    rings = False

    def cache_specs(self, batch, capacity: int, slots: int = 1,
                    max_rows: int | None = None) -> list[CacheSpec]:
        weight = self.lm_head.weight
        return kv_cache_specs(self.config.decoder, batch, capacity, weight.dtype)

    def empty_cache(self, batch: int, capacity: int, slots: int = 1,
                    max_rows: int | None = None) -> list[torch.Tensor]:
        device = self.lm_head.weight.device
        return [torch.zeros(spec.shape, dtype=spec.dtype, device=device)
                for spec in self.cache_specs(batch, capacity, slots, max_rows)]
