"""GPU kernels of ``dspark::MoeExperts`` in Triton: the routed experts as a grouped GEMM by expert,
each expert's weights read once per block of its tokens, experts no token chose never read.

The weights may be float or ``MoeExpertsInt8`` / ``Int4``'s integers and block scales, de-quantized
tile by tile in registers (``_weights``). Four launches on the caller's stream, no allocation (the
scratch is one caller-given buffer) and no host sync, so a CUDA graph can hold them (the
reference's ``unique().tolist()`` cannot be captured):

1. ``_route``: per expert, the (token, choice) pairs that chose it, listed in order;
2. ``_gate_up``: per expert and block of the intermediate width, its pairs' ``act(gate) * up``;
3. ``_down``: per expert and block of the hidden width, ``down @ a`` times the routing weight;
4. ``_combine``: per token, its ``k`` weighted rows summed.

A pair's row never depends on which other pairs share a block (each output element is its own
dot product along K), so a token's output does not depend on its call. Accumulation is fp32 (fp32
inputs at IEEE precision, not TF32); the reference rounds to the input type after each product
and each expert's sum, so fp16 / bf16 outputs agree to that type's rounding, not bit for bit.
Semantics: ``reference.py``.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _route(experts_ptr, counts_ptr, lists_ptr, pairs, BLOCK_P: tl.constexpr):
    """Program e: ``lists[e, :counts[e]]``, the pairs ``t * k + j`` with ``experts[t, j] == e``."""
    e = tl.program_id(0)
    count = 0
    for start in range(0, pairs, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        hit = (tl.load(experts_ptr + p, mask=p < pairs, other=-1) == e).to(tl.int32)
        position = count + tl.cumsum(hit, axis=0) - 1
        tl.store(lists_ptr + e * pairs + position, p, mask=hit > 0)
        count += tl.sum(hit, axis=0)
    tl.store(counts_ptr + e, count)


@triton.jit
def _weights(w_ptr, scales_ptr, e, k, n, K, N, BITS: tl.constexpr, QBLOCK: tl.constexpr):
    """Expert ``e``'s weights ``[k, n]`` (a ``[BLOCK_K, 1]`` by ``[1, BLOCK_N]`` tile of its
    ``[N, K]`` matrix, transposed), fp32: float as stored ``[E, N, K]``, or (``BITS`` 8 / 4) from
    ``MoeExpertsInt{BITS}``'s block-major integers and scales (``export/qdq.py``)."""
    mask = (k < K) & (n < N)
    if BITS == 0:
        return tl.load(w_ptr + e * N * K + n * K + k, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scales_ptr + e * (K // QBLOCK) * N + (k // QBLOCK) * N + n, mask=mask, other=0.0)
    if BITS == 8:                                   # [E, K, N]
        ints = tl.load(w_ptr + e * K * N + k * N + n, mask=mask, other=0).to(tl.float32)
    else:                                           # [E, K/b, b/2, N] bytes, row j + b/2 high
        half: tl.constexpr = QBLOCK // 2
        byte = tl.load(w_ptr + e * (K // 2) * N + (k // QBLOCK) * half * N + (k % half) * N + n,
                       mask=mask, other=0).to(tl.int32) & 255   # the int8's bits
        ints = ((byte >> ((k % QBLOCK) // half * 4)) & 15).to(tl.float32) - 8.0
    return ints * scale.to(tl.float32)


@triton.jit
def _gate_up(x_ptr, gate_up_ptr, gate_up_scales_ptr, counts_ptr, lists_ptr, inter_ptr, pairs, hidden,
             size, TOP_K: tl.constexpr, BITS: tl.constexpr, QBLOCK: tl.constexpr,
             PRECISION: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (e, n): ``inter[p, n block] = act(x_t @ gate[e]ᵀ) * (x_t @ up[e]ᵀ)`` for e's pairs,
    ``act`` SiLU (``ACTIVATION`` 0) or tanh-approximated GELU (1), as ``x * sigmoid(2z)`` with
    ``z = sqrt(2 / pi) (x + 0.044715 x^3)``, the same function."""
    e, n_block = tl.program_id(0), tl.program_id(1)
    count = tl.load(counts_ptr + e)
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    for start in range(0, count, BLOCK_M):
        m = start + tl.arange(0, BLOCK_M)
        p = tl.load(lists_ptr + e * pairs + m, mask=m < count, other=0)
        token = p // TOP_K
        gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + token[:, None] * hidden + k[None, :],
                        mask=(m[:, None] < count) & (k[None, :] < hidden), other=0.0)
            w_gate = _weights(gate_up_ptr, gate_up_scales_ptr, e, k[:, None], n[None, :], hidden,
                              2 * size, BITS, QBLOCK)
            w_up = _weights(gate_up_ptr, gate_up_scales_ptr, e, k[:, None], size + n[None, :], hidden,
                            2 * size, BITS, QBLOCK)
            gate = tl.dot(x, w_gate.to(x.dtype), gate, input_precision=PRECISION)
            up = tl.dot(x, w_up.to(x.dtype), up, input_precision=PRECISION)
        if ACTIVATION == 0:
            a = gate * tl.sigmoid(gate) * up
        else:
            a = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up
        tl.store(inter_ptr + p[:, None] * size + n[None, :], a,
                 mask=(m[:, None] < count) & (n[None, :] < size))


@triton.jit
def _down(inter_ptr, down_ptr, down_scales_ptr, weights_ptr, counts_ptr, lists_ptr, rows_ptr, pairs,
          hidden, size, BITS: tl.constexpr, QBLOCK: tl.constexpr, PRECISION: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (e, n): ``rows[p, n block] = weights[p] * inter[p] @ down[e]ᵀ`` for e's pairs."""
    e, n_block = tl.program_id(0), tl.program_id(1)
    count = tl.load(counts_ptr + e)
    n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    for start in range(0, count, BLOCK_M):
        m = start + tl.arange(0, BLOCK_M)
        p = tl.load(lists_ptr + e * pairs + m, mask=m < count, other=0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, size, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            w = _weights(down_ptr, down_scales_ptr, e, k[:, None], n[None, :], size, hidden, BITS, QBLOCK)
            a = tl.load(inter_ptr + p[:, None] * size + k[None, :],
                        mask=(m[:, None] < count) & (k[None, :] < size), other=0.0)
            dtype = weights_ptr.dtype.element_ty
            acc = tl.dot(a.to(dtype), w.to(dtype), acc, input_precision=PRECISION)
        weight = tl.load(weights_ptr + p, mask=m < count, other=0.0).to(tl.float32)
        tl.store(rows_ptr + p[:, None] * hidden + n[None, :], acc * weight[:, None],
                 mask=(m[:, None] < count) & (n[None, :] < hidden))


@triton.jit
def _combine(rows_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (t, h): ``out[t, h block]``, token t's ``k`` weighted rows summed in order."""
    t, h_block = tl.program_id(0), tl.program_id(1)
    h = h_block * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (t * TOP_K + j) * hidden + h, mask=h < hidden, other=0.0)
    tl.store(out_ptr + t * hidden + h, acc.to(out_ptr.dtype.element_ty), mask=h < hidden)


def workspace_bytes(tokens: int, top_k: int, experts: int, hidden: int, size: int) -> int:
    """The scratch ``moe_experts`` needs: pair counts and lists (int32), and each pair's
    intermediate and output rows (fp32)."""
    pairs = tokens * top_k
    return 4 * (experts + experts * pairs + pairs * size + pairs * hidden)


def sizes(x, experts, gate_up, down, gate_up_scales=None, down_scales=None) -> tuple[int, ...]:
    """``(tokens, k, experts, hidden, intermediate)``, ``workspace_bytes``' arguments, from the
    inputs' shapes: float ``gate_up [E, 2I, H]`` and ``down [E, H, I]``, or with ``*_scales``
    (``[E, H/b, 2I]``, ``[E, I/b, H]``) the quantized forms'."""
    (tokens, hidden), top_k, num_experts = x, experts[1], gate_up[0]
    if gate_up_scales is None:
        return tokens, top_k, num_experts, hidden, down[2]
    return tokens, top_k, num_experts, hidden, down_scales[1] * (hidden // gate_up_scales[1])


def moe_experts(x, experts, weights, gate_up, down, out, workspace=None, gate_up_scales=None,
                down_scales=None, bits: int = 0, activation: int = 0, block_m: int = 16, block_n: int = 64,
                block_k: int = 64):
    """Fill ``out [T, H]`` from ``x [T, H]``, ``experts [T, k]`` (int64), ``weights [T, k]``,
    ``gate_up [E, 2I, H]``, ``down [E, H, I]`` (contiguous), or with ``bits`` 8 / 4 their integers
    and ``*_scales`` as ``MoeExpertsInt{bits}`` takes them; ``workspace`` a flat fp32 tensor of at
    least ``workspace_bytes`` / 4 elements (allocated here when not given); ``activation`` the
    gate's (``plugins.moe.ACTIVATIONS``)."""
    import torch

    dims = sizes(x.shape, experts.shape, gate_up.shape, down.shape,
                 *((gate_up_scales.shape, down_scales.shape) if bits else ()))
    tokens, top_k, num_experts, hidden, size = dims
    qblock = hidden // gate_up_scales.shape[1] if bits else 1
    if workspace is None:
        workspace = torch.empty(workspace_bytes(*dims) // 4, device=x.device)
    pairs = tokens * top_k
    counts = workspace[:num_experts].view(torch.int32)
    lists = workspace[num_experts:num_experts * (1 + pairs)].view(torch.int32)
    inter_start = num_experts * (1 + pairs)
    inter = workspace[inter_start:inter_start + pairs * size]
    rows = workspace[inter_start + pairs * size:inter_start + pairs * (size + hidden)]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    gate_up_scales = gate_up if gate_up_scales is None else gate_up_scales
    down_scales = down if down_scales is None else down_scales
    _route[(num_experts,)](experts, counts, lists, pairs, BLOCK_P=min(1024, triton.next_power_of_2(pairs)))
    _gate_up[(num_experts, triton.cdiv(size, block_n))](
        x, gate_up, gate_up_scales, counts, lists, inter, pairs, hidden, size, TOP_K=top_k, BITS=bits,
        QBLOCK=qblock, PRECISION=precision, ACTIVATION=activation, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k)
    _down[(num_experts, triton.cdiv(hidden, block_n))](
        inter, down, down_scales, weights, counts, lists, rows, pairs, hidden, size, BITS=bits,
        QBLOCK=qblock, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine[(tokens, triton.cdiv(hidden, block_h))](rows, out, hidden, TOP_K=top_k, BLOCK_H=block_h)
