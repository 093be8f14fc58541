"""The quantized product's kernel (``plugins/qmatmul``) in one thread on random weights of one
shape, in each weight form it takes, calls interleaved form by form: what a layout change costs or
saves, before an engine is built.

    python scripts/qmatmul_bench.py --k 2560 --n 19456 --rows 1 8 [--calls 15]

Forms: a Q4_K weight with float32 scales and offsets (``plain``) and with the file's integers
(``kquant``); a Q6_K weight as 6 bits (``q6_k``) and, for its price, as int8 blocks of 32 with float32
scales (``int8``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "ops")]

from test_cpu_kernels import _k_quant, _kernel, _q6_k, _run  # noqa: E402

from plugins.qmatmul import layout  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=2560, help="input size, a multiple of 256 [2560]")
    p.add_argument("--n", type=int, default=19456, help="output size [19456]")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows per call [1 8]")
    p.add_argument("--calls", type=int, default=15, help="timed calls per form and row count [15]")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    q4, kquant = _k_quant(rng, 4, args.k, args.n)
    q6, halves = _q6_k(rng, args.k, args.n)
    forms = {"plain": layout.pack(q4, kquant.scales(), 4, kquant.offsets()),
             "kquant": layout.pack(q4, kquant, 4),
             "q6_k": layout.pack(q6, halves, 6),
             "int8": layout.pack(q6, (rng.random((args.k // 32, args.n)) * 0.01).astype(np.float32), 8)}
    lib = _kernel()
    print(f"[{args.k} x {args.n}], one thread, median ms of {args.calls} calls")
    for rows in args.rows:
        x = rng.standard_normal((rows, args.k)).astype(np.float32)
        times: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(args.calls):
            for name, packed in forms.items():
                started = time.perf_counter()
                _run(lib, x, packed)
                times[name].append(time.perf_counter() - started)
        print(f"  {rows} rows: " + ", ".join(f"{name} {1e3 * statistics.median(t):.2f}"
                                             for name, t in times.items()))


if __name__ == "__main__":
    main()
