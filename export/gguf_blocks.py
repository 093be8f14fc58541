"""A GGUF file's own quantized blocks (``build --weights gguf``): the weights llama.cpp computes with.

``transformers`` loads a GGUF target de-quantized to floats. Quantizing those floats again (``--weights
int4``) is a second rounding on top of the file's: on the demo target (a Q4_1 file) RTN int4 agreed
with the file's own model on 64% of held-out tokens. With ``--weights gguf`` each linear layer keeps
the file's blocks instead, so the engine computes with exactly the weights llama.cpp does.

A layer's weight is matched to the file by its values: each output row is looked up by a digest of
its de-quantized values (computed by ``gguf``, the library ``transformers`` de-quantizes with). No
table of tensor names is needed, nor of the rows ``transformers`` permutes (the q / k projections'
rotary layout).

The kernel (``plugins/qmatmul``) takes blocks of 32 along the input axis: int4 or int8, a scale
per block and, where a format has one, an offset per block added to the block's values. Each type
is written in that form:

- Q4_0 ``d * (q - 8)``, Q8_0 ``d * q``, Q5_0 ``d * (q - 16)`` (as int8): a blocked
  ``DequantizeLinear`` as they are;
- Q4_1 ``d * q + m``: ``d * (q - 8) + (m + 8 d)`` (Q5_1 the same with 16, as int8), no integer
  zero point reproducing ``m``, so a layer's output gains the sums of its input over each block times the
  offsets (a matrix 32 times smaller than the weight), the sum llama.cpp's own dot product adds;
- Q4_K and Q5_K (int8): super-blocks of 256 whose eight sub-blocks of 32 each have a 6-bit scale
  and minimum, ``d sc * q - dmin m``: a scale ``d sc`` and an offset per block of 32, as Q4_1's,
  which the graph makes from the file's integers (``layout.KQuantScales``: 4.625 bits a Q4_K
  weight, where float32 scales and offsets made 6). These keep the file's values (to a rounding of
  the offset's last bit);
- Q6_K: sixteen sub-blocks of 16 with an int8 scale each under an fp16 one, ``d sc * q`` with q
  -32..31: int8 values in blocks of 16 whose scales the graph makes from the file's integers too;
  the kernel packs them as 6 bits (6.5625 bits a weight, the file's own).

A MoE target's experts are 3-D tensors in the file (``blk.N.ffn_gate_exps`` / ``ffn_up_exps`` /
``ffn_down_exps``: each expert's matrix, one after another), whose rows are indexed as a 2-D
tensor's are, so each expert's matrix is found the same way and kept as ``MoeExpertsInt4`` /
``Int8``'s blocks (``qdq.py``). Those take blocks of 32 and no offsets: Q4_1, Q5_1, Q4_K and Q5_K
experts are refused, and Q6_K's rounded again to int8 in blocks of 32 (``quantize.rtn``: a step of
1/127 of the block's largest magnitude, where Q6_K's own is 1/32 of a sub-block's), which the
build gives the PyTorch module first (``engine_values``), so that the graph is still verified
against a reference with exactly its weights. The router (``ffn_gate_inp``) stays float, as
llama.cpp keeps it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from export.quantize import Blocks, chunks, rtn
from modeling.checkpoint import gguf_reader
from plugins.qmatmul.layout import KQuantScales

BLOCK = 32
SUPPORTED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")   # the file's values
# MoeExpertsInt{4,8}'s blocks: of 32, without offsets; Q6_K's rounded again (``rounded``)
EXPERTS_SUPPORTED = ("Q4_0", "Q5_0", "Q8_0", "Q6_K")
ROUTERS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")   # kept float by the engine


def unsupported_matrices(path: Path) -> list[str]:
    """The matrices of the GGUF file at ``path`` that ``--weights gguf`` cannot keep as they are,
    as ``"name (TYPE)"``, read from its header alone so that a build refuses them before loading
    and tracing a model for minutes (F16 matrices or IQ quants, for one). A matrix is a 2-D
    tensor, or a 3-D stack of experts; the token embeddings count only where they are also the
    output layer (no ``output.weight``), since the engine's embedding lookup keeps floats, and a
    MoE router not at all."""
    tensors = gguf_reader(path).tensors
    tied = "output.weight" not in {t.name for t in tensors}
    kept = {2: SUPPORTED, 3: EXPERTS_SUPPORTED}
    return [f"{t.name} ({t.tensor_type.name}{' experts' if len(t.shape) == 3 else ''})" for t in tensors
            if len(t.shape) in kept and t.tensor_type.name not in kept[len(t.shape)]
            and (t.name != "token_embd.weight" or tied) and not t.name.endswith(ROUTERS)]


def rounded(tensor) -> bool:
    """Whether the engine computes with a tensor's values rounded again: a Q6_K stack of experts."""
    return tensor.tensor_type.name == "Q6_K" and len(tensor.shape) == 3


class GgufBlocks:
    """The supported tensors of a GGUF file, indexed by their rows' de-quantized values (an
    expert stack's rows expert after expert) and, for a ``rounded`` one, by the values the engine
    computes with as well."""

    def __init__(self, path: Path):
        from gguf.quants import dequantize

        self.path = path
        tensors = gguf_reader(path).tensors
        self.tensors = [t for t in tensors if t.tensor_type.name in SUPPORTED]
        self.types = sorted({t.tensor_type.name for t in tensors})   # for messages
        self.rounds = any(rounded(t) for t in self.tensors)   # the module is to be given engine_values
        self.rows: dict[bytes, tuple[int, int]] = {}   # row digest -> (tensor, row)
        for index, tensor in enumerate(self.tensors):
            raw = tensor.data.reshape(-1, tensor.data.shape[-1])
            for part in chunks(len(raw)):
                values = dequantize(raw[part], tensor.tensor_type)
                kept = (values, _rounded(values)) if rounded(tensor) else (values,)
                for rows in kept:
                    for row, value in enumerate(rows, part.start):
                        self.rows.setdefault(_digest(value), (index, row))

    def lookup(self, matrix: np.ndarray) -> Blocks | None:
        """The file's blocks of a float32 weight ``matrix [K, N]``, or None when some output row is
        not a row of a supported tensor (another tensor type, or values not the file's). A
        ``rounded`` tensor's rows must hold the values the engine computes with (``engine_values``)."""
        found = self._rows(matrix)
        if found is None:
            return None
        blocks = self._decode(*found)
        if not blocks.reproduces(matrix):
            raise ValueError(f"{self.path}: a weight's blocks do not reproduce its values")
        return blocks

    def engine_values(self, matrix: np.ndarray) -> np.ndarray | None:
        """What the engine computes with for ``matrix [K, N]`` where its rows are a ``rounded``
        tensor's (the file's values rounded again), else None: the build gives these values to the
        PyTorch module before tracing it."""
        found = self._rows(matrix)
        return None if found is None or not found[3] else self._decode(*found).values()

    def _rows(self, matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray, str, bool] | None:
        """``(tensor, row, type, rounded)`` of each of ``matrix [K, N]``'s columns, all from
        tensors of one type, or None."""
        found = [self.rows.get(_digest(column)) for columns in chunks(matrix.shape[1])
                 for column in np.ascontiguousarray(matrix[:, columns].T)]
        if None in found:
            return None
        tensor, row = np.array(found).T
        tensors = [self.tensors[index] for index in np.unique(tensor)]
        kinds = {(t.tensor_type.name, rounded(t)) for t in tensors}
        if len(kinds) > 1:   # rows from tensors of two kinds: not one of the file's layers
            return None
        return tensor, row, *kinds.pop()

    def _decode(self, tensor: np.ndarray, row: np.ndarray, kind: str, rounds: bool) -> Blocks:
        """The blocks of the rows ``row`` of the tensors ``tensor``, as a weight ``[K, N]``."""
        parts: dict[str, np.ndarray] = {}   # decode's parts, [N, ...]
        for index in np.unique(tensor):
            raw = self.tensors[index].data
            raw = raw.reshape(-1, raw.shape[-1])
            chosen = np.flatnonzero(tensor == index)
            for columns in (chosen[part] for part in chunks(len(chosen))):
                for name, part in decode(kind, raw[row[columns]], rounds).items():
                    parts.setdefault(name, np.empty((len(row), part.shape[1]), part.dtype))[columns] = part
        q, scales, offsets, *integers = (np.ascontiguousarray(parts[name].T) if name in parts else None
                                         for name in ("q", "scales", "offsets", "sc", "m", "d", "dmin"))
        bits = 4 if kind in FOUR_BITS else 8
        if "sc" not in parts:
            return Blocks(q, scales, bits, offsets)
        kquant = KQuantScales(*integers, middle=MIDDLE[kind])
        return Blocks(q, kquant.scales(), bits, kquant.offsets(), kquant)


FOUR_BITS = ("Q4_0", "Q4_1", "Q4_K")
MIDDLE = {"Q4_K": 8, "Q5_K": 16, "Q6_K": 32}   # a K-quant's shift to signed values
# bytes per block of each type, and its values per block
LAYOUTS = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32), "Q8_0": (34, 32),
           "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256)}


def decode(kind: str, raw: np.ndarray, rounds: bool = False) -> dict[str, np.ndarray]:
    """Rows of a tensor's raw blocks (``[rows, bytes]``, uint8) -> ``q`` (int8 ``[rows, K]``),
    ``scales`` and, where the format has them, ``offsets`` (``[rows, K / 32]``), with ``scales *
    q + offsets`` the values; a K-quant's the integers and fp16 its scales and offsets are made of
    instead (``KQuantScales``' ``sc``, ``m``, ``d``, ``dmin``, each row's; Q6_K's ``sc`` one per
    16). ``rounds``: Q6_K's values rounded again to int8 blocks of 32 (``rounded``)."""
    if rounds:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        blocks = Blocks(*_rtn8(dequantize(raw, GGMLQuantizationType[kind]).T), bits=8)
        return {"q": blocks.q.T, "scales": blocks.scales.T}
    size, values = LAYOUTS[kind]
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, size)
    d = _half(b, 0)
    if kind == "Q8_0":
        return {"q": np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1), "scales": d}
    if kind == "Q6_K":   # 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, d
        # chunk n of 128 values: value 32 s + l is nibble s // 2 of byte l + 32 (s % 2) of the
        # chunk's 64, and bits 2s, 2s + 1 of its byte l of 32
        low = b[..., :128].reshape(rows, -1, 2, 1, 2, 32) >> np.array([0, 4], np.uint8).reshape(2, 1, 1)
        high = b[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        q = (low & 0x0F).reshape(rows, -1, 2, 4, 32) | ((high & 3) << 4)
        return {"q": (q.astype(np.int16) - MIDDLE[kind]).astype(np.int8).reshape(rows, -1),
                "sc": np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(rows, -1),
                "d": _half(b, 208)}
    if kind in ("Q4_0", "Q4_1"):
        q = {"q": (_nibbles(b[..., size - 16:]) - 8).reshape(rows, -1), "scales": d}
        return q if kind == "Q4_0" else q | {"offsets": _half(b, 2) + 8 * d}
    if kind in ("Q5_0", "Q5_1"):   # bit j of the 32-bit qh is value j's fifth bit
        high = np.ascontiguousarray(b[..., size - 20:size - 16]).view("<u4")
        q = (_nibbles(b[..., size - 16:]) | (((high >> np.arange(32, dtype=np.uint32)) & 1) << 4)) - 16
        q = {"q": q.reshape(rows, -1), "scales": d}
        return q if kind == "Q5_0" else q | {"offsets": _half(b, 2) + 16 * d}
    # Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and minimums, (Q5_K: 32 bytes of fifth bits,)
    # 128 bytes of nibbles: byte l of chunk c holds value l of sub-block 2c (low) and 2c + 1 (high)
    from gguf.quants import Q4_K

    sc, mn = (part.reshape(rows, -1) for part in
              Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12)))
    low = b[..., size - 128:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    q = (low & 0x0F).reshape(rows, -1, 8, 32).astype(np.int16)
    if kind == "Q5_K":   # byte l of qh holds value l's fifth bit of sub-block i at bit i
        high = b[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
        q |= (high & 1).astype(np.int16) << 4
    return {"q": (q - MIDDLE[kind]).astype(np.int8).reshape(rows, -1), "sc": sc.astype(np.uint8),
            "m": mn.astype(np.uint8), "d": d, "dmin": _half(b, 2)}


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte ``at`` of each block, as float32."""
    return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes of nibbles -> 32 values: byte ``j``'s low nibble is value ``j``, its high one ``16 + j``."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8)


def _rtn8(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return rtn(np.ascontiguousarray(matrix, dtype=np.float32), 8, BLOCK)


def _rounded(rows: np.ndarray) -> np.ndarray:
    """A ``ROUNDED`` tensor's rows ``[rows, K]`` as the engine computes with them."""
    return Blocks(*_rtn8(rows.T), bits=8).values().T


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row, dtype=np.float32).tobytes(), digest_size=16).digest()
