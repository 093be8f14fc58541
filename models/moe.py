"""The sparse MoE block of Qwen3-MoE and Qwen3.5-MoE targets (``transformers``' ``Qwen3MoeSparseMoeBlock``,
``Qwen3_5MoeSparseMoeBlock``): a softmax router picks each token's top-k experts, only those run
(``plugins.moe``), and Qwen3.5-MoE adds a shared expert gated by a sigmoid.

Parameters are named as ``transformers`` names them in memory: the router ``gate``, the experts
fused as ``experts.gate_up_proj [E, 2I, H]`` and ``experts.down_proj [E, H, I]``. Checkpoints
store the experts one by one (``experts.{e}.gate_proj.weight``, what ``save_pretrained`` writes and
Qwen3-30B-A3B ships) or fused; ``fuse_experts`` makes the second form of the first at load.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from torch import nn

from plugins.moe import moe_experts

from models.decoder import MLP, DecoderConfig

# the shape fields of a MoE config (transformers assumes a release's numbers when one is missing)
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    expert_size: int                 # each expert's intermediate width
    normalize: bool                  # the top-k weights renormalised to sum to 1
    shared_size: int                 # the shared expert's width (0: none)
    sparse_layers: tuple[bool, ...]  # per layer: a MoE block, else the dense MLP

    @classmethod
    def from_hf(cls, config, *, shared_expert: bool) -> "MoeConfig":
        """Qwen3-MoE (its ``norm_topk_prob``, ``mlp_only_layers`` and ``decoder_sparse_step``) or
        Qwen3.5-MoE (``shared_expert``: every layer sparse, weights renormalised, a shared expert)."""
        layers, experts = config.num_hidden_layers, config.num_experts
        if shared_expert:
            sparse, normalize = (True,) * layers, True
        else:
            dense, step = set(config.mlp_only_layers or ()), config.decoder_sparse_step
            if not (isinstance(step, int) and step >= 1):
                raise ValueError(f"field 'decoder_sparse_step' = {step!r}: expected an integer >= 1")
            sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))
            normalize = bool(config.norm_topk_prob)
        if not 1 <= config.num_experts_per_tok <= experts:
            raise ValueError(f"field 'num_experts_per_tok' = {config.num_experts_per_tok!r}: expected "
                             f"1 .. num_experts ({experts})")
        return cls(num_experts=experts, top_k=config.num_experts_per_tok,
                   expert_size=config.moe_intermediate_size, normalize=normalize,
                   shared_size=config.shared_expert_intermediate_size if shared_expert else 0,
                   sparse_layers=sparse)


class Experts(nn.Module):
    def __init__(self, hidden_size: int, c: MoeConfig):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(c.num_experts, 2 * c.expert_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(c.num_experts, hidden_size, c.expert_size))


class SparseMoe(nn.Module):
    def __init__(self, d: DecoderConfig, c: MoeConfig):
        super().__init__()
        self.c = c
        self.gate = nn.Linear(d.hidden_size, c.num_experts, bias=False)
        self.gate.keep_float = True   # --weights leaves the router float (export/quantize.py)
        self.experts = Experts(d.hidden_size, c)
        if c.shared_size:
            self.shared_expert = MLP(replace(d, intermediate_size=c.shared_size, mlp_bias=False))
            self.shared_expert_gate = nn.Linear(d.hidden_size, 1, bias=False)
            self.shared_expert_gate.keep_float = True

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.flatten(0, 1)
        logits = self.gate(x)
        weights, experts = logits.softmax(dim=-1, dtype=torch.float).topk(self.c.top_k, dim=-1)
        if self.c.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = moe_experts(x, experts, weights.to(logits.dtype), self.experts.gate_up_proj,
                          self.experts.down_proj)
        if self.c.shared_size:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.unflatten(0, h.shape[:2])


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(tensors: dict[str, torch.Tensor], config: MoeConfig) -> None:
    """Replace, in ``tensors``, each layer's per-expert ``experts.{e}.{gate,up,down}_proj.weight``
    by the fused ``experts.gate_up_proj`` / ``experts.down_proj``, releasing each as it is used. A
    layer whose experts are not all there is left as it is, for the shape check to name."""
    layers: dict[str, dict[tuple[int, str], str]] = {}
    for name in tensors:
        if match := _PER_EXPERT.match(name):
            layers.setdefault(match[1], {})[int(match[2]), match[3]] = name
    for prefix, names in layers.items():
        if len(names) != 3 * config.num_experts or {e for e, _ in names} != set(range(config.num_experts)):
            continue
        experts = range(config.num_experts)
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([
            torch.cat([tensors.pop(names[e, "gate_proj"]), tensors.pop(names[e, "up_proj"])])
            for e in experts])
        tensors[f"{prefix}.down_proj"] = torch.stack([tensors.pop(names[e, "down_proj"]) for e in experts])
