"""Time the plugins' Triton kernels on a CUDA GPU at release shapes (Qwen3-8B: 32 query heads,
8 KV heads, head_dim 128; draft block 7, verify block 8; vocabulary 151936).

For each case it prints the kernel's time, the bandwidth it reached on the bytes it must read
(the visible K/V rows, or the scores), and PyTorch's own ops on the same work for scale:
``scaled_dot_product_attention`` over the visible prefix (one sequence at a time, as flash
kernels take it) and ``argmax`` plus an index gather. Rows go to ``--json`` too.

    python scripts/kernel_bench.py --json kernels.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plugins.block_attention.triton_kernel import block_attention  # noqa: E402
from plugins.d2t_gather.triton_kernel import d2t_gather  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, CAPACITY, VOCAB, RANK = 32, 8, 128, 8192, 151936, 256


def attention_case(batch: int, rows: int, context: int, causal: bool, dtype=torch.float16) -> dict:
    """``rows`` new rows per sequence written at ``context`` cached rows."""
    q = torch.randn(batch, HEADS, rows, HEAD_DIM, device="cuda", dtype=dtype)
    k_new, v_new = (torch.randn(batch, KV_HEADS, rows, HEAD_DIM, device="cuda", dtype=dtype)
                    for _ in range(2))
    caches = [torch.randn(batch, KV_HEADS, CAPACITY, HEAD_DIM, device="cuda", dtype=dtype)
              for _ in range(2)]
    start = torch.full((batch,), context, device="cuda", dtype=torch.long)
    out = torch.empty_like(q)
    ms = do_bench(lambda: block_attention(q, k_new, v_new, *caches, start, out, causal=causal,
                                          scale=HEAD_DIM ** -0.5))
    visible = context + rows
    kv_bytes = 2 * batch * KV_HEADS * visible * HEAD_DIM * q.element_size()
    keys, values = (c[:, :, :visible] for c in caches)
    mask = None
    if causal:
        mask = torch.arange(visible, device="cuda") <= context + torch.arange(rows, device="cuda")[:, None]

    def torch_attention():
        for b in range(batch):
            F.scaled_dot_product_attention(q[b:b + 1], keys[b:b + 1], values[b:b + 1], attn_mask=mask,
                                           scale=HEAD_DIM ** -0.5, enable_gqa=True)

    torch_ms = do_bench(torch_attention)
    return dict(kernel="block_attention", batch=batch, rows=rows, context=context, causal=causal,
                ms=ms, gb_per_s=kv_bytes / ms / 1e6, torch_ms=torch_ms)


def d2t_case(batch: int, dtype=torch.float32) -> dict:
    scores = torch.randn(batch, VOCAB, device="cuda", dtype=dtype)
    d2t = torch.zeros(VOCAB, dtype=torch.long, device="cuda")
    w1 = torch.randn(VOCAB, RANK, device="cuda", dtype=torch.float16)
    ids = torch.empty(batch, dtype=torch.long, device="cuda")
    rows = torch.empty(batch, RANK, device="cuda", dtype=torch.float16)
    ms = do_bench(lambda: d2t_gather(scores, d2t, w1, ids, rows))

    def torch_gather():
        best = scores.argmax(-1)
        target = best + d2t[best]
        return w1[target]

    torch_ms = do_bench(torch_gather)
    return dict(kernel="d2t_gather", batch=batch, dtype=str(dtype), ms=ms,
                gb_per_s=scores.numel() * scores.element_size() / ms / 1e6, torch_ms=torch_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    cases = [lambda b=b, r=r, c=c, causal=causal: attention_case(b, r, c, causal)
             for b in (1, 4) for c in (1024, 4096) for r, causal in ((8, True), (7, False))]
    cases += [lambda b=b, c=c: attention_case(b, 512, c, True) for b, c in ((1, 0), (1, 2048), (4, 1024))]
    cases += [lambda b=b: d2t_case(b) for b in (1, 4)]
    results = []
    print(f"{torch.cuda.get_device_name()}: ms per call (Triton) | GB/s on the bytes read | torch ms")
    for case in cases:
        row = case()
        results.append(row)
        timings = ("kernel", "ms", "gb_per_s", "torch_ms")
        shape = ", ".join(f"{k}={v}" for k, v in row.items() if k not in timings)
        print(f"{row['kernel']:>15} {shape:<48} {row['ms']:8.4f} | {row['gb_per_s']:7.0f} | "
              f"{row['torch_ms']:8.4f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
