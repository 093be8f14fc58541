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
- 6 bits (GGUF Q6_K, ``q`` -32..31): the 4-bit groups holding ``q + 32``'s low nibbles, then 2
  groups of 64 bytes of its high two bits: group ``4 + h``, lane ``j``, byte ``i`` holds at bits
  ``2c`` those of ``k = 16h + 4c + i``;

and the scales and offsets as ``[tiles, blocks, 16]``. A K-quant (``KQuantScales``) has instead,
per tile, each block's 16 ``sc`` then 16 ``m`` (uint8 ``[tiles, blocks, 32]``) and each
super-block's 16 ``d`` then 16 ``dmin`` (fp16 ``[tiles, blocks / 8, 32]``): 4.625 bits a weight
where float32 scales and offsets made 6. Q6_K has each block's 16 first-half ``sc`` then 16
second-half ones (int8 ``[tiles, blocks, 32]``) and each super-block's 16 ``d`` (fp16 ``[tiles,
blocks / 8, 16]``): 6.5625 bits a weight, the file's own. The last tile is padded with zero weights.
A float32 or fp16 weight (``FMatMul``, ``HMatMul``) is ``[tiles, K, 32]``: each tile's 32 columns
side by side per ``k``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

BLOCK, TILE = 32, 16


SUPER = 8   # a K-quant's blocks per super-block


@dataclass
class KQuantScales:
    """A GGUF K-quant's scales as the file holds them, for a weight ``[K, N]``: per sub-block an
    integer scale ``sc`` (and for Q4_K / Q5_K a minimum ``m``), per super-block of 256 an fp16 ``d``
    (and ``dmin``). Q4_K / Q5_K: sub-blocks of 32, 6-bit ``sc`` and ``m``; a block's values are
    ``d sc (q - middle) + middle d sc - dmin m``, q the file's unsigned integers: its scale ``d sc``
    and offset ``middle d sc - dmin m``, each product exact in float32, so the kernel makes them
    from these as they are read (``scales``, ``offsets``). Q6_K: sub-blocks of 16, int8 ``sc``,
    values ``d sc q`` with q -32..31, no offsets."""
    sc: np.ndarray            # uint8 [K / 32, N] (Q6_K: int8 [K / 16, N])
    m: np.ndarray | None      # uint8 [K / 32, N], or None (Q6_K)
    d: np.ndarray             # float32 [K / 256, N], fp16 values
    dmin: np.ndarray | None   # float32 [K / 256, N], fp16 values, or None (Q6_K)
    middle: int               # 8 (Q4_K), 16 (Q5_K): what the signed values were shifted by; Q6_K 32

    def scales(self) -> np.ndarray:
        return np.repeat(self.d, len(self.sc) // len(self.d), axis=0) * self.sc.astype(np.float32)

    def offsets(self) -> np.ndarray | None:
        if self.m is None:
            return None
        return (np.float32(self.middle) * self.scales()
                - np.repeat(self.dmin, SUPER, axis=0) * self.m.astype(np.float32))

    def columns(self, which: slice) -> KQuantScales:
        pick = lambda a: None if a is None else a[:, which]   # noqa: E731
        return KQuantScales(pick(self.sc), pick(self.m), pick(self.d), pick(self.dmin), self.middle)


@dataclass
class Packed:
    """The arrays ``kernel.cpp``'s ``DsparkQWeight`` points at (empty when absent)."""
    bits: int
    n: int                 # real columns
    q: np.ndarray          # uint8 [tiles, K / 32, bits * 64]: 4, 6 (Q6_K) or 8 bits
    scales: np.ndarray     # float32 [tiles, K / 32, 16], or [0] for a K-quant
    offsets: np.ndarray    # float32 [tiles, K / 32, 16] or [0]
    sums: np.ndarray       # int32 [tiles, K / 32, 16] (8 bits) or [0]
    sub: np.ndarray        # a K-quant's uint8 [tiles, K / 32, 32] (sc, m; Q6_K's two sc), or [0]
    super: np.ndarray      # a K-quant's float16 [tiles, K / 256, 32] (d, dmin; Q6_K's 16: d), or [0]
    middle: int = 0        # a K-quant's


def supported(q: np.ndarray, block: int, bits: int) -> bool:
    """Whether the kernel takes a weight: blocks of 32, and int8 values in -127..127 (the AVX2
    path puts x's sign on them, which -128 would overflow; llama.cpp's Q8_0 and our RTN never
    write -128), or Q6_K's: blocks of 16 (of a K-quant's scales) in super-blocks of 256, values
    -32..31, packed as 6 bits."""
    if block == BLOCK // 2:
        return bits == 8 and q.shape[0] % (SUPER * BLOCK) == 0 and -32 <= int(q.min()) and int(q.max()) < 32
    return (block == BLOCK and q.shape[0] % BLOCK == 0 and bits in (4, 8)
            and (bits == 4 or int(q.min()) >= -127))


PACKED_AT_ONCE = 1 << 24   # values of a weight packed in one piece (a few working bytes each)


def pack(q: np.ndarray, scales: np.ndarray | KQuantScales, bits: int,
         offsets: np.ndarray | None = None) -> Packed:
    """``q [K, N]`` (int8 values), ``scales`` and ``offsets`` ``[K / 32, N]`` (or a K-quant's
    scales, which make both) -> the kernel's layout. ``bits`` 6 packs Q6_K's. Packed some tiles
    of columns at a time, each into its place: a vocabulary-sized weight's working copies (the
    shifted bytes, the nibbles, their transposes) would be several times its packed size at once."""
    k, n = q.shape
    step = max(TILE, PACKED_AT_ONCE // k // TILE * TILE)
    if n <= step:
        return _pack_columns(q, scales, bits, offsets)
    tiles = -(-n // TILE)
    whole = None
    for start in range(0, n, step):
        which = slice(start, start + step)
        part = _pack_columns(q[:, which], scales.columns(which) if isinstance(scales, KQuantScales)
                             else scales[:, which], bits, None if offsets is None else offsets[:, which])
        if whole is None:
            whole = replace(part, n=n, **{field: np.empty((tiles, *array.shape[1:]), array.dtype)
                                          for field, array in _arrays(part) if array.size})
        for field, array in _arrays(part):
            if array.size:
                getattr(whole, field)[start // TILE:start // TILE + len(array)] = array
    return whole


def _arrays(packed: Packed) -> list[tuple[str, np.ndarray]]:
    return [(field, getattr(packed, field)) for field in ("q", "scales", "offsets", "sums", "sub", "super")]


def _pack_columns(q: np.ndarray, scales: np.ndarray | KQuantScales, bits: int,
                  offsets: np.ndarray | None) -> Packed:
    """``pack`` in one piece."""
    k, n = q.shape
    pad = -n % TILE
    tiles, blocks = (n + pad) // TILE, k // BLOCK
    # the values' bytes: q + 8 (q + 32) is the same byte in uint8 arithmetic, without a wider copy
    q = np.pad(q, ((0, 0), (0, pad))) if pad else q
    q = q.astype(np.int8, copy=False).view(np.uint8)

    def per_tile(per_block: np.ndarray, dtype) -> np.ndarray:   # [rows, N] -> [tiles, rows, 16]
        padded = np.pad(per_block.astype(dtype), ((0, 0), (0, pad)))
        return np.ascontiguousarray(padded.reshape(len(padded), tiles, TILE).transpose(1, 0, 2))

    if bits in (4, 6):
        # k = 32 b + 16 h + 4 g + i -> [blocks, h, g, i, tiles, j]
        u = (q + np.uint8(8 if bits == 4 else 32)).reshape(blocks, 2, 4, 4, tiles, TILE)
        nibbles = (u[:, 0] & 15) | ((u[:, 1] & 15) << 4)             # [blocks, g, i, tiles, j]
        packed = nibbles.transpose(3, 0, 1, 4, 2).reshape(tiles, blocks, 4 * 64)
        if bits == 6:   # the high two bits of k = 16 h + 4 c + i, at bits 2c: [blocks, h, i, tiles, j]
            high = sum((u[:, :, c] >> 4) << (2 * c) for c in range(4)).astype(np.uint8)
            high = high.transpose(3, 0, 1, 4, 2).reshape(tiles, blocks, 2 * 64)
            packed = np.concatenate([packed, high], axis=-1)
        sums = np.zeros(0, np.int32)
    else:
        # k = 32 b + 4 g + i -> [blocks, g, i, tiles, j]
        packed = q.reshape(blocks, 8, 4, tiles, TILE).transpose(3, 0, 1, 4, 2).reshape(tiles, blocks, 8 * 64)
        block_sums = q.view(np.int8).reshape(blocks, BLOCK, -1).sum(axis=1, dtype=np.int32)
        sums = per_tile(block_sums[:, :n], np.int32)
    if bits == 6:
        halves = [per_tile(scales.sc[half::2], np.int8) for half in (0, 1)]
        return Packed(6, n, np.ascontiguousarray(packed), np.zeros(0, np.float32), np.zeros(0, np.float32),
                      sums, np.concatenate(halves, axis=-1).view(np.uint8),
                      per_tile(scales.d.astype(np.float16), np.float16), scales.middle)
    if isinstance(scales, KQuantScales):
        half = [s.astype(np.float16) for s in (scales.d, scales.dmin)]
        if not all(np.array_equal(h, s) for h, s in zip(half, (scales.d, scales.dmin))):
            raise ValueError("a K-quant's d and dmin must be fp16 values")
        sub = np.concatenate([per_tile(scales.sc, np.uint8), per_tile(scales.m, np.uint8)], axis=-1)
        super_ = np.concatenate([per_tile(h, np.float16) for h in half], axis=-1)
        return Packed(bits, n, np.ascontiguousarray(packed), np.zeros(0, np.float32), np.zeros(0, np.float32),
                      sums, sub, super_, scales.middle)
    return Packed(bits, n, np.ascontiguousarray(packed), per_tile(scales, np.float32),
                  np.zeros(0, np.float32) if offsets is None else per_tile(offsets, np.float32), sums,
                  np.zeros(0, np.uint8), np.zeros(0, np.float16))


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
    """What the kernel computes for ``x [M, K]`` and the weight ``q [K, N]``, ``scales [K / 32, N]``
    (Q6_K's ``[K / 16, N]``) and ``offsets [K / 32, N]``, in float64 (the kernel's float32
    rounding aside): per block (Q6_K: half block), the exact integer dot product of x's int8
    values with ``q``, times both scales, plus the offset times the block's float sum of x."""
    xq, xscale, xsum = quantize_rows(x)
    m, k = x.shape
    blocks = len(scales)
    size = k // blocks
    dots = np.einsum("mbi,bin->mbn", xq.reshape(m, blocks, size).astype(np.int64),
                     q.reshape(blocks, size, -1).astype(np.int64))
    xscale = np.repeat(xscale, BLOCK // size, axis=1)
    y = (dots * xscale[..., None].astype(np.float64) * scales[None].astype(np.float64)).sum(axis=1)
    if offsets is not None:
        y += xsum.astype(np.float64) @ offsets.astype(np.float64)
    return y
