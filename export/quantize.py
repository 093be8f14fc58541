"""Weight-only int4 / int8 quantization of the linear layers (``build --weights``): the rounding
and the PyTorch module's weights. The graph gets the same blocks from ``qdq.py``; the cost is
measured in ``quality.py``.

Symmetric, blockwise round-to-nearest along each weight's input axis. int4 is the rounding of ONNX
Runtime's ``MatMulNBitsQuantizer`` (a block's scale is its largest-magnitude value over -8, so it
takes that value's sign; the values are rounded and clipped to [-8, 7]; ``tests/graphs/test_quantize.py``
holds the two equal). int8 takes a positive scale, the largest magnitude over 127, and [-127, 127]:
TensorRT's ONNX parser refuses a negative int8 scale ("Scale coefficients must all be positive"; it
lets int4's through), and ONNX Runtime fuses either. The router stays float (``keep_float``), as
llama.cpp keeps it: a rounded router may pick other experts.

The PyTorch module is quantized first (``quantize_linears``): its weights become the de-quantized
values, so the reference that verifies the graph computes with exactly the graph's weights. The
rounding is idempotent (a block's extreme value maps to -8 or +-127 and back to itself), so
quantizing those values again in the traced graph gives the same integers and scales.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# the weight formats live where the command line checks them without loading anything
from export.build_checks import BITS, FLOAT, GGUF, GGUF_DRAFT  # noqa: F401
from export.onnx_check import to_numpy
from modeling.lazy_weights import DeferredWeights, placeholder
from plugins.qmatmul.layout import KQuantScales

# columns (a GGUF file's rows) rounded, de-quantized or looked up at a time: a vocabulary-sized
# weight's float temporaries stay small
COLUMNS = 4096


def chunks(count: int) -> list[slice]:
    """``range(count)`` as slices of ``COLUMNS``."""
    return [slice(start, start + COLUMNS) for start in range(0, count, COLUMNS)]


def rtn(matrix: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """``matrix [K, N]`` (K a multiple of ``block``) -> ``(q int8 [K, N], scales [K / block, N])``,
    the scales in ``matrix``'s dtype."""
    k, n = matrix.shape
    q, scales = np.empty((k, n), np.int8), np.empty((k // block, n), matrix.dtype)
    for columns in chunks(n):
        blocks = matrix[:, columns].astype(np.float32).reshape(k // block, block, -1)
        high, low = blocks.max(axis=1), blocks.min(axis=1)
        if bits == 4:
            scale = np.where(np.abs(high) > np.abs(low), high, low) / -8
        else:
            scale = np.maximum(np.abs(high), np.abs(low)) / 127
        safe = np.where(scale == 0, 1, scale)[:, None]
        rounded = np.clip(np.round(blocks / safe), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        q[:, columns], scales[:, columns] = rounded.reshape(k, -1), scale
    return q, scales


def float_weights(module: torch.nn.Module) -> set[str]:
    """The weights quantization leaves float: those of the linear layers inside a submodule that
    sets ``keep_float`` (the draft's Markov head), by their names in the module and its graph."""
    kept = {id(m) for holder in module.modules() if getattr(holder, "keep_float", False)
            for m in holder.modules()}
    return {f"{name}.weight" for name, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and id(m) in kept}


def quantizable(module: torch.nn.Module) -> tuple[list[torch.nn.Linear], list[torch.nn.Module]]:
    """The linear layers quantization rounds (all but ``float_weights``'), and the MoE layers'
    expert stacks (two matrices each)."""
    from modeling.moe import Experts

    kept = float_weights(module)
    linears = [m for name, m in module.named_modules()
               if isinstance(m, torch.nn.Linear) and f"{name}.weight" not in kept]
    return linears, [m for m in module.modules() if isinstance(m, Experts)]


def quantize_linears(module: torch.nn.Module, bits: int, block: int, embeddings: bool = False) -> int:
    """Replace the weight of every ``nn.Linear`` whose input size is a multiple of ``block`` by
    its de-quantized values, as a new tensor (a tied ``lm_head`` leaves the embedding as it was),
    except ``float_weights``, and so each MoE layer's two expert matrices; with ``embeddings``, give
    the token embeddings their int8 rows' values too (``round_embeddings``). Returns how many
    matrices were replaced, the embeddings not counted; none is refused, so no engine is labelled
    quantized that is not."""
    rounded = _rounded_matrices(module, block)
    for owner, attribute in rounded:
        setattr(owner, attribute, dequantized(getattr(owner, attribute), bits, block))
    if embeddings:
        round_embeddings(module)
    return len(rounded)


def rounded_as_read(module: torch.nn.Module, weights: DeferredWeights, bits: int, block: int,
                    embeddings: bool = False) -> tuple[int, DeferredWeights]:
    """``quantize_linears`` for a module that holds ``lazy_weights`` placeholders: each matrix it
    rounds gets a placeholder of its own (a tied ``lm_head`` leaves the embedding as it was), and
    the weights returned round it (and with ``embeddings`` the token embeddings' rows) as it is
    read, in the module's dtype. Returns them and how many matrices they round."""
    rounded = _rounded_matrices(module, block)
    names = {id(owner): name for name, owner in module.named_modules()}
    for owner, attribute in rounded:
        weight = getattr(owner, attribute)
        setattr(owner, attribute,
                torch.nn.Parameter(placeholder(weight.shape, weight.dtype), requires_grad=False))
    matrices = {f"{names[id(owner)]}.{attribute}" for owner, attribute in rounded}
    embedding = "embed_tokens.weight" if embeddings and hasattr(module, "embed_tokens") else None
    dtypes = {name: parameter.dtype for name, parameter in module.named_parameters(remove_duplicate=False)}

    def prepare(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in matrices:
            return dequantized(tensor, bits, block, dtypes[name]).data
        if name == embedding:   # in place: a lazy weight is read anew each time (``LazyWeights``)
            tensor = tensor.to(dtypes[name])
            _round_rows(tensor, _embedding_values)
        return tensor
    return len(rounded), weights.then(prepare)


def _rounded_matrices(module: torch.nn.Module, block: int) -> list[tuple[torch.nn.Module, str]]:
    """``(owner, attribute)`` of each matrix ``quantize_linears`` rounds: ``quantizable``'s whose
    input size is a multiple of ``block``; none is an error."""
    linears, stacks = quantizable(module)
    rounded = [(linear, "weight") for linear in linears if not linear.in_features % block]
    rounded += [(experts, attribute) for experts in stacks
                if not (experts.gate_up_proj.shape[-1] % block or experts.down_proj.shape[-1] % block)
                for attribute in ("gate_up_proj", "down_proj")]
    if not rounded:
        sizes = sorted({m.in_features for m in linears})
        raise ValueError(f"--weights-block {block}: no linear layer's input size ({sizes}) is a "
                         f"multiple of it; choose a smaller block")
    return rounded


def round_weights(module: torch.nn.Module, values_of: Callable[[np.ndarray], np.ndarray | None],
                  matrices: bool = True) -> int:
    """Overwrite, in place, each weight the graph may hold as blocks (``quantizable``'s matrices,
    unless not ``matrices``, and the token embeddings) for which ``values_of(weight [K, N])`` gives
    values, and return how many: a GGUF file's weights where the engine rounds them again
    (``gguf_blocks.rounded``), or the embeddings' int8 rows (``EMBEDDING_BITS``), so that the
    reference verifying the graph computes with the graph's weights. In place, so that a tied
    ``lm_head`` stays the embedding."""
    linears, stacks = quantizable(module) if matrices else ([], [])
    weights = [linear.weight for linear in linears] + [m for s in stacks for pair in
                                                       (s.gate_up_proj, s.down_proj) for m in pair]
    embedding = getattr(module, "embed_tokens", None)
    weights += [] if embedding is None else [embedding.weight]
    with torch.no_grad():
        return sum(_round_rows(weight, values_of) for weight in weights)


def _round_rows(weight: torch.Tensor, values_of: Callable[[np.ndarray], np.ndarray | None]) -> bool:
    """``round_weights`` of one weight ``[N, K]``, ``chunks`` of rows at a time, views both ways
    (a vocabulary is GBs): whether ``values_of`` gave values."""
    parts = chunks(weight.shape[0])
    for index, rows in enumerate(parts):
        values = values_of(to_numpy(weight[rows].T))
        if values is None and index:
            raise ValueError(f"a [{weight.shape[0]}, {weight.shape[1]}] weight's rows from "
                             f"{rows.start} have no values where those before them had")
        if values is None:
            return False
        weight[rows] = torch.from_numpy(values).T
    return True


def dequantized(weight: torch.Tensor, bits: int, block: int,
                dtype: torch.dtype | None = None) -> torch.nn.Parameter:
    """``weight [..., N, K]`` (a linear layer's, or a stack of experts') in ``dtype`` (its own
    unless given), rounded in blocks along K, ``chunks`` of a matrix's rows at a time (a
    vocabulary-sized ``lm_head`` is GBs, and a bf16 one is not copied whole in float32)."""
    dtype = dtype or weight.dtype
    matrices = weight.detach().reshape(-1, *weight.shape[-2:])
    values = torch.empty(matrices.shape, dtype=dtype)
    for index, matrix in enumerate(matrices):
        for rows in chunks(matrix.shape[0]):
            blocks = Blocks(*rtn(to_numpy(matrix[rows].T.to(dtype)), bits, block), bits)
            values[index, rows] = torch.from_numpy(blocks.values()).T.to(dtype)
    return torch.nn.Parameter(values.reshape(weight.shape), requires_grad=False)


@dataclass
class Blocks:
    """A linear layer's weight ``[K, N]`` as a blocked ``DequantizeLinear(q, scales)`` (the block
    size is ``K / len(scales)``) plus, for formats that have one, an offset per block."""
    q: np.ndarray                       # int8 [K, N]: int4 (-8..7) or int8 values
    scales: np.ndarray                  # [K / block, N]
    bits: int                           # 4 or 8: the ONNX type of q
    offsets: np.ndarray | None = None   # float32 [K / block, N] (GGUF Q4_1), added to a block's values
    kquant: KQuantScales | None = None  # a GGUF K-quant's: what its scales and offsets are made of

    @property
    def block(self) -> int:
        return self.q.shape[0] // self.scales.shape[0]

    def columns(self, which: slice) -> Blocks:
        """The blocks of some of the weight's columns (views)."""
        return Blocks(self.q[:, which], self.scales[:, which], self.bits,
                      None if self.offsets is None else self.offsets[:, which],
                      None if self.kquant is None else self.kquant.columns(which))

    def values(self) -> np.ndarray:
        """What the graph computes with, in the scales' dtype: ``DequantizeLinear(q, scales, axis=0,
        block_size=block)``, plus each block's offset."""
        weight = np.empty(self.q.shape, self.scales.dtype)
        for columns in chunks(weight.shape[1]):
            expand = lambda per_block: np.repeat(per_block[:, columns].astype(np.float32),  # noqa: E731
                                                 self.block, axis=0)
            part = self.q[:, columns].astype(np.float32) * expand(self.scales)
            if self.offsets is not None:
                part += expand(self.offsets)
            weight[:, columns] = part
        return weight

    def reproduces(self, matrix: np.ndarray) -> bool:
        """Whether these blocks give ``matrix [K, N]``'s values (to float32 rounding of a scale
        times an integer plus an offset), checked some columns at a time."""
        scale = max(float(matrix.max()), -float(matrix.min()))
        return all(np.allclose(self.columns(part).values(), matrix[:, part], rtol=1e-6, atol=1e-6 * scale)
                   for part in chunks(matrix.shape[1]))


# a weight matrix [K, N] (a view, perhaps of a mapped file: read it some columns at a time) -> its
# blocks as a graph holds them, or None where it stays float
BlocksOf = Callable[[np.ndarray], "Blocks | None"]


# a quantized engine's token embeddings: int8 rows in blocks of 32, gathered and de-quantized row
# by row (``qdq._quantize_embeddings``), a quarter of their float32 bytes (the 0.6b preset's 622 MB
# table, in its draft engine too, 165 MB)
EMBEDDING_BITS, EMBEDDING_BLOCK = 8, 32


def round_embeddings(module: torch.nn.Module) -> int:
    """Give ``module``'s token embeddings their int8 rows' values (``EMBEDDING_BITS``), in place."""
    return round_weights(module, _embedding_values, matrices=False)


def _embedding_values(matrix: np.ndarray) -> np.ndarray | None:
    """``round_weights``' values of an embedding table's int8 rows."""
    blocks = rtn_blocks(EMBEDDING_BITS, EMBEDDING_BLOCK)(matrix)
    return None if blocks is None else blocks.values().astype(np.float32, copy=False)


def rounded_embedding_blocks(table: np.ndarray) -> Blocks | None:
    """``qdq.quantize_graph``'s ``embeddings`` for ``round_embeddings``: a table's int8 rows where
    they give the values it holds (a table the module rounded), else None (it stays float)."""
    blocks = rtn_blocks(EMBEDDING_BITS, EMBEDDING_BLOCK)(table)
    return blocks if blocks is not None and blocks.reproduces(table) else None


def rtn_blocks(bits: int, block: int) -> BlocksOf:
    """``quantize_graph``'s blocks for RTN: every layer whose input size is a multiple of ``block``."""
    def blocks_of(matrix: np.ndarray) -> Blocks | None:
        return None if matrix.shape[0] % block else Blocks(*rtn(matrix, bits, block), bits=bits)
    return blocks_of
