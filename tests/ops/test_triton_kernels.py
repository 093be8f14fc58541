"""The Triton kernels against their PyTorch references: on CPU tensors under TRITON_INTERPRET=1
(set by conftest when there is no GPU), on CUDA where there is one; and compiled ahead of time for
a GPU target, which needs no GPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from plugins.block_attention import triton_kernel as attention_kernel  # noqa: E402
from plugins.block_attention.reference import block_attention as attention_reference  # noqa: E402
from plugins.compile_kernels import KERNELS  # noqa: E402
from plugins.d2t_gather import triton_kernel as d2t_kernel  # noqa: E402
from plugins.d2t_gather.reference import d2t_gather as d2t_reference  # noqa: E402

pytestmark = pytest.mark.slow   # the real-model tier: Triton kernels, interpreted on a CPU

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]


def check_block_attention(batch, heads, kv_heads, head_dim, rows, capacity, start, causal, dtype,
                          tolerance, **options):
    """The kernel's output and in-place cache writes against the reference, on random data."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, rows, head_dim, generator=g)
    k_new, v_new = (torch.randn(batch, kv_heads, rows, head_dim, generator=g) for _ in range(2))
    k_cache, v_cache = (torch.randn(batch, kv_heads, capacity, head_dim, generator=g) for _ in range(2))
    start = torch.tensor(start)
    scale = head_dim ** -0.5
    expected, k_expected, v_expected = attention_reference(q, k_new, v_new, k_cache, v_cache, start,
                                                           causal, scale)
    on = [t.to(DEVICE, dtype) for t in (q, k_new, v_new, k_cache, v_cache)]
    out = torch.empty_like(on[0])
    attention_kernel.block_attention(*on, start.to(DEVICE), out, causal=causal, scale=scale, **options)
    assert (out.float().cpu() - expected).abs().max() < tolerance
    assert torch.equal(on[3].cpu(), k_expected.to(dtype)) and torch.equal(on[4].cpu(), v_expected.to(dtype))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype, tolerance, splits", [(torch.float32, 1e-4, 1), (torch.float16, 2e-2, 3)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (6, 6, 24)])
def test_block_attention_kernel(causal, dtype, tolerance, splits, heads, kv_heads, head_dim):
    """Ragged starts (the last sequence fills the cache), odd head sizes, the cache in one pass or
    split across programs and merged, and tiles smaller than the block."""
    check_block_attention(3, heads, kv_heads, head_dim, rows=5, capacity=48, start=[0, 9, 43],
                          causal=causal, dtype=dtype, tolerance=tolerance, splits=splits, block_n=16)


@pytest.mark.parametrize("rows, causal, start", [
    (8, True, [2040, 17]),        # verify block at the end of a 2048-row cache, and near its start
    (7, False, [900, 0]),         # draft block
    (24, True, [100, 37]),        # a prefill chunk: several query tiles per KV head
])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4)] + [
    pytest.param(dtype, 3e-2, marks=pytest.mark.skipif(DEVICE == "cpu", reason=(
        "on CPU: numpy multiplies fp16 slowly, and Triton 3.9's interpreter multiplies bf16 "
        "tl.dot operands as integers; the small cases above cover fp16")))
    for dtype in (torch.float16, torch.bfloat16)])
def test_block_attention_kernel_at_release_shapes(rows, causal, start, dtype, tolerance):
    """Qwen3-8B's attention (32 query heads over 8 KV heads, head_dim 128): GQA groups stacked in
    one tile, the cache split across programs (on CPU in 2 splits, not the GPU plan's 8 to 16:
    the interpreter's cost is per program)."""
    plan = attention_kernel.plan(2, 32, 8, rows)
    assert plan.splits > 2 and plan.block_m * plan.tiles >= 4 * rows
    check_block_attention(2, 32, 8, 128, rows, capacity=2048, start=start, causal=causal, dtype=dtype,
                          tolerance=tolerance, splits=2 if DEVICE == "cpu" else None)


def test_block_attention_plan_bounds_its_workspace():
    """Any shape's partial results fit the workspace a TensorRT plugin reserves once."""
    bound = attention_kernel.workspace_bound(128)
    for batch in (1, 2, 4, 16):
        for rows in (1, 7, 8, 64, 512, 2048):
            for heads, kv_heads in ((32, 8), (16, 8), (40, 8), (8, 8)):
                plan = attention_kernel.plan(batch, heads, kv_heads, rows)
                group_rows = rows * heads // kv_heads
                assert plan.block_m * plan.tiles >= group_rows
                assert plan.workspace_floats(batch, kv_heads, group_rows, 128) * 4 <= bound


@pytest.mark.parametrize("vocab, block", [(100, 32), (7, 1024)])
def test_d2t_gather_kernel(vocab, block):
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(5, vocab, generator=g)
    scores[1, 3] = scores[1, vocab - 1] = 99.0             # a tie: the lowest id wins, as torch.argmax
    scores[2, vocab - 1] = 99.0                           # the last id, in the last block
    d2t = torch.randint(0, 4, (vocab,), generator=g)
    d2t[0] = 0
    markov_w1 = torch.randn(vocab + 4, 8, generator=g)
    ids, rows = torch.empty(5, dtype=torch.long, device=DEVICE), torch.empty(5, 8, device=DEVICE)
    d2t_kernel.d2t_gather(scores.to(DEVICE), d2t.to(DEVICE), markov_w1.to(DEVICE), ids, rows, block_v=block)
    expected_ids, expected_rows = d2t_reference(scores, d2t, markov_w1)
    assert torch.equal(ids.cpu(), expected_ids) and torch.equal(rows.cpu(), expected_rows)
    assert ids[1] == 3 + d2t[3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_d2t_gather_kernel_across_blocks_at_release_vocabulary(dtype):
    """Qwen3's vocabulary split over many programs: winners folded across blocks must keep
    torch.argmax's answer for negative rows, ties in different blocks and -0.0 against +0.0."""
    g = torch.Generator().manual_seed(2)
    vocab, rank = 151936, 256
    scores = torch.randn(5, vocab, generator=g)
    scores[1] = -5.0 - torch.rand(vocab, generator=g)     # all negative, best in a late block
    scores[1, 150000] = -1.5
    scores[2, 5000] = scores[2, 140000] = 9.0              # a tie in different blocks: lowest id
    scores[3] = -1.0
    scores[3, 10], scores[3, 9000] = -0.0, 0.0             # equal as floats: the first wins
    scores[4, vocab - 1] = 9.0                             # the last id of a partial block
    scores = scores.to(dtype)
    d2t = torch.randint(0, 3, (vocab,), generator=g)
    markov_w1 = torch.randn(vocab + 3, rank, generator=g).half()
    ids = torch.empty(5, dtype=torch.long, device=DEVICE)
    rows = torch.empty(5, rank, dtype=torch.float16, device=DEVICE)
    d2t_kernel.d2t_gather(scores.to(DEVICE), d2t.to(DEVICE), markov_w1.to(DEVICE), ids, rows)
    expected_ids, expected_rows = d2t_reference(scores, d2t, markov_w1)
    assert scores.argmax(-1)[1:].tolist() == [150000, 5000, 10, vocab - 1]
    assert torch.equal(ids.cpu(), expected_ids) and torch.equal(rows.cpu(), expected_rows)


def test_kernels_compile_ahead_of_time_for_sm89_without_a_gpu():
    """In a fresh process without TRITON_INTERPRET (interpreter mode patches the compiler)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "plugins.compile_kernels", "--gpu", "sm89"],
                            cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) == len(KERNELS) and all("sm89: cubin" in line for line in lines)
