"""``HybridTargetStep``: one forward of a Qwen3.5 / Qwen3.6 hybrid target (``transformers``'
``modeling_qwen3_5.py``), over the caches a speculative step needs.

Three of every four layers are gated DeltaNet linear attention: a causal depthwise conv over the
q/k/v projections, then the gated delta rule (``plugins.gated_delta``), a recurrence over a
per-head state, its output gated through an RMSNorm by ``z``. The others are full attention with
an output gate, q/k norms and a partial rotary. Norms are zero-centred (``x * (1 + w)``).

A linear layer's caches are banks of ``N`` slots (``N = k + 1``): its conv window ``[B, K-1, N,
conv_dim]`` and its recurrent state ``[B, N, H, Dk, Dv]`` (fp32). A call starts from slot
``state_slot[b]`` and writes into slots ``0 .. R-1`` the window and state after rows
``state_rows[b]`` (``-1``: before the call), which is how a verify step keeps the state after
every row without knowing yet how many will be accepted (``docs/engine-contract.md``,
"Recurrent state"). A full layer's caches are K / V as in ``dense.TargetStep``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from modeling.checkpoint import CheckpointError
from modeling.decoder import (
    MLP,
    CachedStep,
    CacheSpec,
    Rotary,
    apply_rotary,
    embedded,
    kv_cache_specs,
    logits_and_aux,
    rms_normalized,
)
from modeling.moe import SparseMoe
from plugins.block_attention import block_attention
from plugins.cache_write import cache_write
from plugins.gated_delta import gated_delta_rule

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The hybrid layout: each layer's type, and the gated DeltaNet's shapes."""
    layer_types: tuple[str, ...]
    conv_kernel: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    @classmethod
    def from_hf(cls, config) -> "LinearAttentionConfig":
        return cls(layer_types=tuple(config.layer_types), conv_kernel=config.linear_conv_kernel_dim,
                   num_key_heads=config.linear_num_key_heads,
                   num_value_heads=config.linear_num_value_heads,
                   key_head_dim=config.linear_key_head_dim, value_head_dim=config.linear_value_head_dim)


class ZeroCentredRMSNorm(nn.Module):
    """``x / rms(x) * (1 + w)`` in fp32, cast back last (Qwen3.5's norm; weights stored around 0)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalized(x, self.eps) * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """``w * x / rms(x) * silu(gate)``: the DeltaNet output's norm, gated by ``z``."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (self.weight * rms_normalized(x, self.eps).to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear attention, parameters named as its checkpoints name them."""

    def __init__(self, hidden_size: int, c: LinearAttentionConfig, eps: float):
        super().__init__()
        self.c = c
        key_dim, value_dim = c.num_key_heads * c.key_head_dim, c.num_value_heads * c.value_head_dim
        self.in_proj_qkv = nn.Linear(hidden_size, 2 * key_dim + value_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, c.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, c.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel, groups=c.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(c.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(c.num_value_heads))
        self.norm = GatedRMSNorm(c.value_head_dim, eps)
        self.out_proj = nn.Linear(value_dim, hidden_size, bias=False)

    def forward(self, x, conv_bank, state_bank, state_slot, state_rows):
        """``x [B, S, hidden]``; the banks as the module docstring says -> output, both banks."""
        c = self.c
        mixed = self.in_proj_qkv(x)                                            # [B, S, conv_dim]
        # the conv sees the window before the call, then the new rows
        picked = state_slot[:, None, None, None].expand(-1, c.conv_kernel - 1, 1, c.conv_dim)
        window = conv_bank.gather(2, picked)[:, :, 0]
        seen = torch.cat([window, mixed], dim=1)                              # [B, K-1+S, conv_dim]
        mixed = F.silu(self.conv1d(seen.transpose(1, 2))).transpose(1, 2)
        # the window after row r is rows r+1 .. r+K-1 of seen (r = -1: the old window)
        picks = state_rows[:, :, None] + 1 + torch.arange(c.conv_kernel - 1, device=x.device)
        windows = seen.gather(1, picks.flatten(1)[..., None].expand(-1, -1, c.conv_dim))
        windows = windows.unflatten(1, (state_rows.shape[1], c.conv_kernel - 1)).transpose(1, 2)
        conv_bank = cache_write(conv_bank, windows, torch.zeros_like(state_slot))
        key_dim = c.num_key_heads * c.key_head_dim
        q, k, v = mixed.split([key_dim, key_dim, c.num_value_heads * c.value_head_dim], dim=-1)
        q = _l2norm(q.unflatten(-1, (c.num_key_heads, c.key_head_dim)).float())
        q = q / math.sqrt(c.key_head_dim)
        k = _l2norm(k.unflatten(-1, (c.num_key_heads, c.key_head_dim)).float())
        v = v.unflatten(-1, (c.num_value_heads, c.value_head_dim)).float()
        beta = self.in_proj_b(x).sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out, state_bank = gated_delta_rule(q, k, v, g, beta, state_bank, state_slot, state_rows)
        z = self.in_proj_z(x).unflatten(-1, (c.num_value_heads, c.value_head_dim))
        out = self.norm(out.to(x.dtype), z).flatten(-2)
        return self.out_proj(out), conv_bank, state_bank


class GatedAttention(nn.Module):
    """Full attention with q / k norms, a partial rotary and a sigmoid output gate per head; its
    ``q_proj`` holds each head's query and gate side by side."""

    def __init__(self, d):
        super().__init__()
        heads, kv_heads, head_dim, bias = d.num_heads, d.num_kv_heads, d.head_dim, d.attention_bias
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(d.hidden_size, 2 * heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d.hidden_size, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d.hidden_size, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, d.hidden_size, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(head_dim, d.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(head_dim, d.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, start):
        query, gate = self.q_proj(x).unflatten(-1, (self.heads, 2 * self.head_dim)).chunk(2, dim=-1)
        q = _partial_rotary(self.q_norm(query).transpose(1, 2), cos, sin)
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))).transpose(1, 2)
        k = _partial_rotary(k, cos, sin)
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(1, 2)
        o, k_cache, v_cache = block_attention(q, k, v, k_cache, v_cache, start, causal=True,
                                              scale=self.head_dim ** -0.5)
        o = o.transpose(1, 2).flatten(-2) * torch.sigmoid(gate.flatten(-2))
        return self.o_proj(o), k_cache, v_cache


def _partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of each head, pass the rest."""
    width = cos.shape[-1]
    return torch.cat([apply_rotary(x[..., :width], cos, sin), x[..., width:]], dim=-1)


class HybridLayer(nn.Module):
    def __init__(self, config, layer_type: str):
        super().__init__()
        d, eps = config.decoder, config.decoder.rms_norm_eps
        self.input_layernorm = ZeroCentredRMSNorm(d.hidden_size, eps)
        if layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(d.hidden_size, config.linear, eps)
        else:
            self.self_attn = GatedAttention(d)
        self.post_attention_layernorm = ZeroCentredRMSNorm(d.hidden_size, eps)
        self.mlp = SparseMoe(d, config.moe) if config.moe is not None else MLP(d)

    def forward(self, h, cos, sin, first, second, start, state_slot, state_rows):
        """``first, second``: this layer's two caches (K, V or conv window, state)."""
        x = self.input_layernorm(h)
        if hasattr(self, "linear_attn"):
            mixed, first, second = self.linear_attn(x, first, second, state_slot, state_rows)
        else:
            mixed, first, second = self.self_attn(x, cos, sin, first, second, start)
        h = h + mixed
        return h + self.mlp(self.post_attention_layernorm(h)), first, second


class HybridTargetStep(CachedStep, nn.Module):
    """``TargetStep``'s contract plus ``state_slot [B]`` and ``state_rows [B, R]`` after
    ``logit_rows``; per layer two caches, in layer order: ``k, v`` for a full layer, ``conv,
    state`` for a linear one."""

    def __init__(self, config, taps=()):
        super().__init__()
        d = config.decoder
        self.config = config
        self.taps = tuple(sorted(taps))
        self.embed_tokens = nn.Embedding(config.vocab_size, d.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(config, t) for t in config.linear.layer_types)
        self.norm = ZeroCentredRMSNorm(d.hidden_size, d.rms_norm_eps)
        self.lm_head = nn.Linear(d.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(d)

    def forward(self, input_ids, start, logit_rows, state_slot, state_rows, *caches):
        h, cos, sin, aux = embedded(self, input_ids, start)
        new_caches = []
        for index, layer in enumerate(self.layers):
            h, first, second = layer(h, cos, sin, caches[2 * index], caches[2 * index + 1], start,
                                     state_slot, state_rows)
            new_caches += [first, second]
            if index in self.taps:
                aux.append(h)
        return *logits_and_aux(h, aux, logit_rows, self.norm, self.lm_head), *new_caches

    takes_states = True

    def cache_specs(self, batch, capacity: int, slots: int = 1,
                    max_rows: int | None = None) -> list[CacheSpec]:
        """Per layer: K / V ``[B, Hkv, C, D]`` for a full layer; for a linear one the conv window
        bank ``conv [B, K-1, slots, conv_dim]`` (model dtype) and the state bank ``state [B, slots, H,
        Dk, Dv]`` (fp32)."""
        d, c, dtype = self.config.decoder, self.config.linear, self.lm_head.weight.dtype
        specs = []
        for layer, layer_type in enumerate(c.layer_types):
            if layer_type == LINEAR:
                specs += [CacheSpec("conv", layer, (batch, c.conv_kernel - 1, slots, c.conv_dim), dtype),
                          CacheSpec("state", layer, (batch, slots, c.num_value_heads, c.key_head_dim,
                                                     c.value_head_dim), torch.float32)]
            else:
                specs += kv_cache_specs(d, batch, capacity, dtype, layers=[layer])
        return specs


def check_layer_types(tensors: dict[str, torch.Tensor], config, fields: str) -> None:
    """``Family.check_weights``: each layer's weights are of the kind ``layer_types`` names (linear
    or full attention); ``fields`` starts the message (the config file and where its fields sit)."""
    where = f"{fields}layer_types'"
    for index, kind in enumerate(config.linear.layer_types):
        held = "linear_attn" if any(n.startswith(f"layers.{index}.linear_attn.") for n in tensors) \
            else "self_attn" if any(n.startswith(f"layers.{index}.self_attn.") for n in tensors) else None
        expected = "linear_attn" if kind == "linear_attention" else "self_attn"
        if held != expected:
            raise CheckpointError(f"{where}[{index}] = {kind!r}, but the weights hold "
                                  f"{f'layers.{index}.{held}.*' if held else 'no attention'} for that layer")
