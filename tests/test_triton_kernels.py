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
from plugins.d2t_gather import triton_kernel as d2t_kernel  # noqa: E402
from plugins.d2t_gather.reference import d2t_gather as d2t_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (6, 6, 24)])
def test_block_attention_kernel(causal, dtype, tolerance, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(0)
    batch, rows, capacity = 3, 5, 48
    q = torch.randn(batch, heads, rows, head_dim, generator=g)
    k_new, v_new = (torch.randn(batch, kv_heads, rows, head_dim, generator=g) for _ in range(2))
    k_cache, v_cache = (torch.randn(batch, kv_heads, capacity, head_dim, generator=g) for _ in range(2))
    start = torch.tensor([0, 9, capacity - rows])          # ragged; the last row fills the cache
    expected, k_expected, v_expected = attention_reference(q, k_new, v_new, k_cache, v_cache, start,
                                                           causal, 0.3)
    on = [t.to(DEVICE, dtype) for t in (q, k_new, v_new, k_cache, v_cache)]
    out = torch.empty_like(on[0])
    attention_kernel.block_attention(*on, start.to(DEVICE), out, causal=causal, scale=0.3, block_n=16)
    assert (out.float().cpu() - expected).abs().max() < tolerance * 10
    assert torch.equal(on[3].cpu(), k_expected.to(dtype)) and torch.equal(on[4].cpu(), v_expected.to(dtype))


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


def test_kernels_compile_ahead_of_time_for_sm89_without_a_gpu():
    """In a fresh process without TRITON_INTERPRET (interpreter mode patches the compiler)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "plugins.compile_kernels", "--gpu", "sm89"],
                            cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and all("sm89: cubin" in line for line in lines)
