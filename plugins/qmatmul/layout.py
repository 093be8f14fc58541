"""A block-quantized weight in ``kernel.cpp``'s layout, and what the kernel computes, in numpy.

The engine keeps a quantized layer as ``export.quantize.Blocks``: ``q [K, N]`` (int4 -8..7 or int8),
``scales [K / 32, N]`` and, for GGUF Q4_1 / Q5_1 / Q4_K / Q5_K, ``offsets [K / 32, N]``. The
kernel wants the columns 16 at a time (one SIMD lane each) and, inside a lane, 4 consecutive
``k`` (what one ``vpdpbusd`` or ``maddubs`` takes), so the layout is, per tile of 16 columns and
block of 32 ``k``:

- 4 bits: 4 groups of 64 bytes; group ``g``, lane ``j``, byte ``i`` holds ``q + 8`` of
  ``k = 4g + i`` in its low nibble and of ``k = 16 + 4g + i`` in its high one;
- 8 bits: 8 groups of 64 bytes; group ``g``, lane ``j``, byte ``i`` holds ``q`` of ``k = 4g + i``,
  and each column's sum of ``q`` over the block (the kernel's unsigned-operand correction);

and the scales and offsets as ``[tiles, blocks, 16]``. The last tile is padded with zero weights.
A float32 or fp16 weight (``FMatMul``, ``HMatMul``) is ``[tiles, K, 32]``: each tile's 32 columns
side by side per ``k``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK, TILE = 32, 16


@dataclass
class Packed:
    """The arrays ``kernel.cpp``'s ``DsparkQWeight`` points at (offsets and sums empty when absent)."""
    bits: int
    n: int                 # real columns
    q: np.ndarray          # uint8 [tiles, K / 32, bits * 64]
    scales: np.ndarray     # float32 [tiles, K / 32, 16]
    offsets: np.ndarray    # float32 [tiles, K / 32, 16] or [0]
    sums: np.ndarray       # int32 [tiles, K / 32, 16] (8 bits) or [0]


def supported(q: np.ndarray, block: int, bits: int) -> bool:
    """Whether the kernel takes a weight: blocks of 32, and int8 values in -127..127 (the AVX2
    path puts x's sign on them, which -128 would overflow; llama.cpp's Q8_0 and our RTN never
    write -128)."""
    return (block == BLOCK and q.shape[0] % BLOCK == 0 and bits in (4, 8)
            and (bits == 4 or int(q.min()) >= -127))


def pack(q: np.ndarray, scales: np.ndarray, bits: int, offsets: np.ndarray | None = None) -> Packed:
    """``q [K, N]`` (int8 values), ``scales`` and ``offsets`` ``[K / 32, N]`` -> the kernel's layout."""
    k, n = q.shape
    pad = -n % TILE
    tiles, blocks = (n + pad) // TILE, k // BLOCK
    q = np.pad(q, ((0, 0), (0, pad))).astype(np.int16)

    def per_tile(per_block: np.ndarray, dtype) -> np.ndarray:   # [blocks, N] -> [tiles, blocks, 16]
        padded = np.pad(per_block.astype(dtype), ((0, 0), (0, pad)))
        return np.ascontiguousarray(padded.reshape(blocks, tiles, TILE).transpose(1, 0, 2))

    if bits == 4:
        # k = 32 b + 16 h + 4 g + i -> [blocks, h, g, i, tiles, j]
        u = (q + 8).astype(np.uint8).reshape(blocks, 2, 4, 4, tiles, TILE)
        nibbles = u[:, 0] | (u[:, 1] << 4)                           # [blocks, g, i, tiles, j]
        packed = nibbles.transpose(3, 0, 1, 4, 2).reshape(tiles, blocks, 4 * 64)
        sums = np.zeros(0, np.int32)
    else:
        # k = 32 b + 4 g + i -> [blocks, g, i, tiles, j]
        values = q.astype(np.int8).view(np.uint8).reshape(blocks, 8, 4, tiles, TILE)
        packed = values.transpose(3, 0, 1, 4, 2).reshape(tiles, blocks, 8 * 64)
        sums = per_tile(q.reshape(blocks, BLOCK, -1).sum(axis=1)[:, :n], np.int32)
    return Packed(bits, n, np.ascontiguousarray(packed), per_tile(scales, np.float32),
                  np.zeros(0, np.float32) if offsets is None else per_tile(offsets, np.float32), sums)


FLOAT_TILE = 32


def pack_float(matrix: np.ndarray, transposed: bool = False) -> np.ndarray:
    """A float weight ``[K, N]`` (``transposed``: stored as ``[N, K]``) -> ``[tiles, K, 32]`` in its
    own dtype (float32 for ``FMatMul``, fp16 for ``HMatMul``), the last tile padded. One copy,
    no temporaries: a weight mapped from its file costs its packed size only."""
    columns = matrix.T if transposed else matrix   # [K, N], a view
    k, n = columns.shape
    full = n // FLOAT_TILE
    packed = np.zeros((-(-n // FLOAT_TILE), k, FLOAT_TILE), matrix.dtype)
    packed[:full] = columns[:, :full * FLOAT_TILE].reshape(k, full, FLOAT_TILE).transpose(1, 0, 2)
    if n % FLOAT_TILE:
        packed[full, :, :n % FLOAT_TILE] = columns[:, full * FLOAT_TILE:]
    return packed


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x [M, K]`` -> ``(q int8 [M, K], scale [M, K / 32], float sum [M, K / 32])``: per row and
    block, scale ``max|x| / 127`` and ``q = round(x / scale)`` (half to even), as the kernel does."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, BLOCK)
    scale = np.abs(blocks).max(axis=-1) / np.float32(127)
    inverse = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale != 0)
    q = np.rint(blocks * inverse[..., None]).astype(np.int8)
    return q.reshape(x.shape), scale, blocks.sum(axis=-1)


def reference(x: np.ndarray, q: np.ndarray, scales: np.ndarray,
              offsets: np.ndarray | None = None) -> np.ndarray:
    """What the kernel computes for ``x [M, K]`` and the weight ``q [K, N]``, ``scales`` /
    ``offsets [K / 32, N]``, in float64 (the kernel's float32 rounding aside): per block, the
    exact integer dot product of x's int8 values with ``q``, times both scales, plus the offset
    times the block's float sum of x."""
    xq, xscale, xsum = quantize_rows(x)
    m, k = x.shape
    blocks = k // BLOCK
    dots = np.einsum("mbi,bin->mbn", xq.reshape(m, blocks, BLOCK).astype(np.int64),
                     q.reshape(blocks, BLOCK, -1).astype(np.int64))
    y = (dots * xscale[..., None].astype(np.float64) * scales[None].astype(np.float64)).sum(axis=1)
    if offsets is not None:
        y += xsum.astype(np.float64) @ offsets.astype(np.float64)
    return y
