"""PyTorch reference of ``dspark::GatedDeltaRule``.

Per sequence ``b`` and value head ``h`` (key head ``h // (H / Hk)``), from the state
``s = state[b, slot[b], h]`` ``[Dk, Dv]``, for each row ``i``:

    s = s * exp(g_i)                       # decay
    delta = (v_i - s^T k_i) * beta_i       # what the state mispredicts for k_i
    s = s + k_i delta^T                    # the delta-rule write
    out_i = s^T q_i

in fp32, in the order ``transformers``' ``torch_recurrent_gated_delta_rule`` computes it (q and k
come l2-normalised, q scaled by ``Dk ** -0.5``). Then slot ``j < R`` of the bank holds the state
after row ``state_rows[b, j]`` (``-1``: the starting state); slots ``R ..`` are kept. The starting
slot is read before any slot is written.
"""
from __future__ import annotations

import torch


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, slot: torch.Tensor,
                     state_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q, k [B, S, Hk, Dk]``, ``v [B, S, H, Dv]``, ``g, beta [B, S, H]``, ``state [B, N, H, Dk, Dv]``
    (all fp32), ``slot [B]``, ``state_rows [B, R]`` (int64, ``-1 .. S-1``, ``R <= N``) ->
    ``out [B, S, H, Dv]``, the updated state bank."""
    batch, rows, key_heads, _ = k.shape
    group = v.shape[2] // key_heads
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    s = state[torch.arange(batch, device=state.device), slot]                 # [B, H, Dk, Dv]
    hit = state_rows[..., None, None, None]                                   # [B, R, 1, 1, 1]
    captured = s[:, None].expand(-1, state_rows.shape[1], -1, -1, -1)
    out = []
    for i in range(rows):
        s = s * g[:, i].exp()[..., None, None]
        remembered = (s * k[:, i, :, :, None]).sum(dim=-2)
        delta = (v[:, i] - remembered) * beta[:, i, :, None]
        s = s + k[:, i, :, :, None] * delta[:, :, None, :]
        out.append((s * q[:, i, :, :, None]).sum(dim=-2))
        captured = torch.where(hit == i, s[:, None], captured)
    return torch.stack(out, dim=1), torch.cat([captured, state[:, state_rows.shape[1]:]], dim=1)
