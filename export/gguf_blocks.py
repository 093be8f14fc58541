"""A GGUF file's own quantized blocks (``build --weights gguf``): the weights llama.cpp computes with.

``transformers`` loads a GGUF target de-quantized to floats. Quantizing those floats again (``--weights
int4``) is a second rounding on top of the file's: on the demo target (a Q4_1 file) RTN int4 agreed
with the file's own model on 64% of held-out tokens. With ``--weights gguf`` each linear layer keeps
the file's blocks instead, so the engine computes with exactly the weights llama.cpp does.

A layer's weight is matched to the file by its values: each output row is looked up by a digest of
its de-quantized values (computed by ``gguf``, the library ``transformers`` de-quantizes with). No
table of tensor names is needed, nor of the rows ``transformers`` permutes (the q / k projections'
rotary layout).

In blocks of 32 along the input axis, Q4_0 is ``d * (q - 8)`` and Q8_0 ``d * q``: a blocked
``DequantizeLinear`` as they are. Q4_1 is ``d * q + m``, which no integer zero point reproduces; it
is ``d * (q - 8)`` plus a per-block offset ``m + 8 d``, so a layer's output gains the sums of its
input over each block times the offsets (a matrix 32 times smaller than the weight) — the sum that
llama.cpp's own Q4_1 dot product adds.

A MoE target's experts are 3-D tensors in the file (``blk.N.ffn_gate_exps`` / ``ffn_up_exps`` /
``ffn_down_exps``: each expert's matrix, one after another), whose rows are indexed as a 2-D
tensor's are, so each expert's matrix is found the same way and kept as ``MoeExpertsInt4`` /
``Int8``'s blocks (``qdq.py``). Those have no per-block offsets: Q4_1 experts are refused. The
router (``ffn_gate_inp``) stays float, as llama.cpp keeps it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from export.quantize import Blocks

BLOCK = 32
SUPPORTED = ("Q4_0", "Q4_1", "Q8_0")
EXPERTS_SUPPORTED = ("Q4_0", "Q8_0")   # MoeExpertsInt{4,8}'s blocks have no offsets
ROUTERS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")   # kept float by the engine


def unsupported_matrices(path: Path) -> list[str]:
    """The matrices of the GGUF file at ``path`` that ``--weights gguf`` cannot keep as they are,
    as ``"name (TYPE)"``, read from its header alone so that a build refuses them before loading
    and tracing a model for minutes (Q4_K_M files hold Q4_K and Q6_K, for one). A matrix is a 2-D
    tensor, or a 3-D stack of experts; the token embeddings count only where they are also the
    output layer (no ``output.weight``), since the engine's embedding lookup keeps floats, and a
    MoE router not at all."""
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    tied = "output.weight" not in {t.name for t in tensors}
    kept = {2: SUPPORTED, 3: EXPERTS_SUPPORTED}
    return [f"{t.name} ({t.tensor_type.name}{' experts' if len(t.shape) == 3 else ''})" for t in tensors
            if len(t.shape) in kept and t.tensor_type.name not in kept[len(t.shape)]
            and (t.name != "token_embd.weight" or tied) and not t.name.endswith(ROUTERS)]


class GgufBlocks:
    """The Q4_0 / Q4_1 / Q8_0 tensors of a GGUF file, indexed by their rows' de-quantized values
    (an expert stack's rows expert after expert)."""

    def __init__(self, path: Path):
        from gguf import GGUFReader
        from gguf.quants import dequantize

        self.path = path
        tensors = GGUFReader(path).tensors
        self.tensors = [t for t in tensors if t.tensor_type.name in SUPPORTED]
        self.types = sorted({t.tensor_type.name for t in tensors})   # for messages
        self.rows: dict[bytes, tuple[int, int]] = {}   # row digest -> (tensor, row)
        for index, tensor in enumerate(self.tensors):
            values = dequantize(tensor.data, tensor.tensor_type)
            for row, value in enumerate(values.reshape(-1, values.shape[-1])):
                self.rows.setdefault(_digest(value), (index, row))

    def lookup(self, matrix: np.ndarray) -> Blocks | None:
        """The file's blocks of a float32 weight ``matrix [K, N]``, or None when some output row is
        not a row of a supported tensor (another tensor type, or values not the file's)."""
        found = [self.rows.get(_digest(column)) for column in np.ascontiguousarray(matrix.T)]
        if None in found:
            return None
        tensor, row = np.array(found).T
        kinds = {self.tensors[index].tensor_type.name for index in np.unique(tensor)}
        if len(kinds) > 1:   # rows from tensors of two types: not one of the file's layers
            return None
        kind = kinds.pop()
        n, k = matrix.shape[1], matrix.shape[0]
        q = np.empty((n, k), np.int8)
        scales = np.empty((n, k // BLOCK), np.float32)
        offsets = np.empty_like(scales) if kind == "Q4_1" else None
        for index in np.unique(tensor):
            columns = np.flatnonzero(tensor == index)
            raw = self.tensors[index].data
            q[columns], scales[columns], offset = _decode(kind, raw.reshape(-1, raw.shape[-1])[row[columns]])
            if offsets is not None:
                offsets[columns] = offset
        transposed = (None if part is None else np.ascontiguousarray(part.T) for part in (q, scales, offsets))
        q, scales, offsets = transposed
        blocks = Blocks(q, scales, 8 if kind == "Q8_0" else 4, offsets)
        if not np.allclose(blocks.values(), matrix, rtol=1e-6, atol=1e-6 * float(np.abs(matrix).max())):
            raise ValueError(f"{self.path}: a weight's blocks do not reproduce its values")
        return blocks


def _decode(kind: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Rows of raw blocks (``[rows, bytes]``, uint8) -> ``(q int8 [rows, K], scales [rows, K / 32],
    offsets [rows, K / 32] or None)``. A 4-bit block holds 16 bytes of nibbles: value ``j``
    is byte ``j``'s low nibble, value ``16 + j`` its high nibble."""
    rows = raw.shape[0]
    header = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}[kind]
    blocks = raw.reshape(rows, -1, header + (BLOCK if kind == "Q8_0" else BLOCK // 2))
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., header:]
    if kind == "Q8_0":
        return np.ascontiguousarray(packed).view(np.int8).reshape(rows, -1), d, None
    nibbles = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8) - 8
    offsets = None
    if kind == "Q4_1":   # d * q + m = d * (q - 8) + (m + 8 d)
        m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
        offsets = m + 8 * d
    return nibbles.reshape(rows, -1), d, offsets


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row, dtype=np.float32).tobytes(), digest_size=16).digest()
