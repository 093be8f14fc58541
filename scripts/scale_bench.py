"""Build release-shaped random pairs and record wall time, peak RSS and output sizes.

    .venv/bin/python scripts/scale_bench.py [--presets qwen3-0.6b qwen3-1.7b qwen3-4b]
        [--backends onnx trt-rtx] [--dtypes fp16 fp32 bf16] [--work /tmp/dspark-scale]
        [--out docs/scale.json]

Each build runs in its own process under ``/usr/bin/time -v`` (batch 1, 2048 positions;
TensorRT-RTX ahead of time for SM89), so its peak RSS is that process's alone. The pairs
(``make-tiny --preset``) are kept in ``--work`` and reused. A benchmark, not a test: the 4B pair
takes tens of minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = {"onnx": [], "trt-rtx": ["--backend", "trt-rtx", "--gpu", "sm89"]}


def timed(command: list[str]) -> tuple[float, int]:
    """Run ``command`` under ``/usr/bin/time -v``: (wall seconds, peak RSS bytes); its output is
    shown only when it fails."""
    started = time.perf_counter()
    run = subprocess.run(["/usr/bin/time", "-v", *command], cwd=ROOT, capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{run.stdout[-2000:]}{run.stderr[-4000:]}")
    peak_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1))
    return time.perf_counter() - started, peak_kb * 1024


def main() -> None:
    from common.outputs import writable_file
    from modeling.fixtures.presets import PRESETS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", choices=list(PRESETS), default=["qwen3-0.6b", "qwen3-1.7b"])
    p.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=list(BACKENDS))
    p.add_argument("--dtypes", nargs="+", choices=["fp16", "fp32", "bf16"], default=["fp16"])
    p.add_argument("--work", type=Path, default=Path("/tmp/dspark-scale"))
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "scale.json")
    args = p.parse_args()
    writable_file(args.out, "--out")
    python = [sys.executable, "-m", "export"]
    rows = json.loads(args.out.read_text()) if args.out.is_file() else {}
    for preset in args.presets:
        pair = args.work / preset
        if not (pair / "draft" / "config.json").is_file():
            timed([*python, "make-tiny", str(pair), "--preset", preset, "--force"])
        for backend, dtype in ((b, d) for b in args.backends for d in args.dtypes):
            out = args.work / f"{preset}-{backend}-{dtype}"
            seconds, peak = timed([*python, "build", "--target", str(pair / "target"), "--draft",
                                   str(pair / "draft"), "--out", str(out), "--dtype", dtype,
                                   "--max-batch", "1", "--max-seq-len", "2048", "--quiet", "--force",
                                   *BACKENDS[backend]])
            sizes = {f.name: f.stat().st_size for f in out.iterdir() if f.is_file()}
            weights = sum(size for name, size in sizes.items() if name.endswith(".onnx.data"))
            rows[f"{preset} {backend} {dtype}"] = {
                "preset": preset, "backend": backend, "dtype": dtype, "seconds": round(seconds, 1),
                "peak_rss_bytes": peak, "onnx_weight_bytes": weights,
                "peak_over_weights": round(peak / weights, 2),
                "engine_bytes": sum(s for name, s in sizes.items() if name.endswith(".engine")),
                "files": sizes, "date": time.strftime("%Y-%m-%d")}
            print(f"{preset:12} {backend:8} {dtype:5} {seconds:7.0f} s   peak RSS {peak / 1e9:6.2f} GB   "
                  f"ONNX weights {weights / 1e9:6.2f} GB   ratio {peak / weights:.2f}", flush=True)
            args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
