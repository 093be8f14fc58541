"""GPU kernel of ``dspark::GatedDeltaRule``: one program per sequence, value head and block of
value columns keeps its ``[Dk, BLOCK_V]`` tile of the state in registers across the rows, so the
state is read once and written once per captured slot, never per row. Launches on the caller's
stream; no allocation, no host sync."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _recur(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot_ptr, rows_ptr, out_ptr,
           rows, heads, key_heads, slots, captured,
           KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
           BLOCK_V: tl.constexpr):
    """Program (b * heads + h, value block): the reference's loop for those columns."""
    bh, block = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    kh = h // (heads // key_heads)
    dk = tl.arange(0, BLOCK_K)
    dv = block * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = dk < KEY_DIM, dv < VALUE_DIM
    tile = dk[:, None] * VALUE_DIM + dv[None, :]
    tile_mask = k_mask[:, None] & v_mask[None, :]
    head_state = (h * KEY_DIM * VALUE_DIM).to(tl.int64)
    slot_size = (heads * KEY_DIM * VALUE_DIM).to(tl.int64)
    start_slot = tl.load(slot_ptr + b)
    s = tl.load(state_ptr + (b * slots + start_slot) * slot_size + head_state + tile, mask=tile_mask,
                other=0.0)
    for j in range(captured):                         # slots that keep the starting state
        if tl.load(rows_ptr + b * captured + j) == -1:
            tl.store(state_ptr + (b * slots + j) * slot_size + head_state + tile, s, mask=tile_mask)
    for i in range(rows):
        token = b * rows + i
        k = tl.load(k_ptr + (token * key_heads + kh) * KEY_DIM + dk, mask=k_mask, other=0.0)
        q = tl.load(q_ptr + (token * key_heads + kh) * KEY_DIM + dk, mask=k_mask, other=0.0)
        v = tl.load(v_ptr + (token * heads + h) * VALUE_DIM + dv, mask=v_mask, other=0.0)
        decay = tl.exp(tl.load(g_ptr + token * heads + h))
        beta = tl.load(beta_ptr + token * heads + h)
        s = s * decay
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        tl.store(out_ptr + (token * heads + h) * VALUE_DIM + dv, tl.sum(s * q[:, None], axis=0),
                 mask=v_mask)
        for j in range(captured):
            if tl.load(rows_ptr + b * captured + j) == i:
                tl.store(state_ptr + (b * slots + j) * slot_size + head_state + tile, s,
                         mask=tile_mask)


def gated_delta_rule(q, k, v, g, beta, state, slot, state_rows, out, block_v: int = 32) -> None:
    """The reference's semantics with ``state`` updated in place and ``out`` written; contiguous
    fp32 tensors (int64 ``slot``, ``state_rows``) on one device."""
    batch, rows, key_heads, key_dim = k.shape
    heads, value_dim = v.shape[2:]
    block_v = min(block_v, triton.next_power_of_2(value_dim))
    grid = (batch * heads, triton.cdiv(value_dim, block_v))
    _recur[grid](q, k, v, g, beta, state, slot, state_rows, out, rows, heads, key_heads,
                 state.shape[1], state_rows.shape[1], KEY_DIM=key_dim, VALUE_DIM=value_dim,
                 BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_v)
