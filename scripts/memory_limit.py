"""Run ``python -m export build`` inside a memory cgroup limited to a multiple of the weights it
will write, or ``python -m runtime.generate`` inside one limited to a multiple of the weights its
engine holds, and report whether it completed there.

    sudo .venv/bin/python scripts/memory_limit.py --ratio 1.5 -- --target T --draft D --out OUT \\
        [build flags...]
    sudo .venv/bin/python scripts/memory_limit.py --ratio 1.3 -- --engine E [generate flags...]

Peak RSS counts the pages of the weight files a build maps, which the kernel reclaims under
pressure, so the goal (a build within 1.5x the weights it writes) is measured as a limit, not a
peak: a cgroup v1 ``memory.limit_in_bytes`` (this machine's; needs root) of ``ratio`` times the
target's and draft's checkpoint tensors at the build's dtype, which is what an unquantized build
writes (for a ``.gguf`` target: the GGUF file and the draft's safetensors files as they are, the
bytes the build reads). Afterwards the ONNX weights actually written are summed and the limit is
reported against them too. A generation's limit is a multiple of its engine's ``*.onnx.data``
files. A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CGROUPS = Path("/sys/fs/cgroup/memory")
BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def checkpoint_bytes(directory: Path, skip: tuple[str, ...], width: int) -> int:
    """The tensors of ``directory``'s safetensors files at ``width`` bytes per value, those whose
    names start with ``skip`` (a vision tower, an MTP layer: never read) left out."""
    from safetensors import safe_open

    total = 0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "np") as file:
            total += sum(math.prod(file.get_slice(name).get_shape()) * width
                         for name in file.keys() if not name.startswith(skip))
    return total


def limited(command: list[str], limit: int) -> tuple[subprocess.CompletedProcess, float, int, int]:
    """Run ``command`` (from the repository) in a fresh cgroup of ``limit`` bytes: (its result,
    seconds, the cgroup's peak bytes, times it hit the limit)."""
    group = CGROUPS / f"dspark-limit-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        started = time.perf_counter()

        def join():
            (group / "cgroup.procs").write_text(str(os.getpid()))

        run = subprocess.run(command, cwd=ROOT, preexec_fn=join, capture_output=True, text=True)
        wall = time.perf_counter() - started
        return (run, wall, int((group / "memory.max_usage_in_bytes").read_text()),
                int((group / "memory.failcnt").read_text()))
    finally:
        group.rmdir()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ratio", type=float, default=1.5)
    p.add_argument("flags", nargs=argparse.REMAINDER,
                   help="-- then python -m export build's flags, or python -m runtime.generate's")
    args = p.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    given = dict(zip(flags, flags[1:]))   # each flag to the value after it
    if "--engine" in given:
        engine = Path(given["--engine"])
        weights = sum(f.stat().st_size for f in engine.glob("*.onnx.data"))
        limit = int(args.ratio * weights)
        run, wall, peak, hits = limited([sys.executable, "-m", "runtime.generate", *flags], limit)
        report = {"generate": " ".join(flags), "completed": run.returncode == 0, "wall_s": round(wall),
                  "engine_weights_gb": round(weights / 1e9, 2), "limit_gb": round(limit / 1e9, 2),
                  "cgroup_peak_gb": round(peak / 1e9, 2), "times_at_limit": hits,
                  "output": run.stdout[-300:], "stats": run.stderr[-600:]}
    else:
        target, draft, out = Path(given["--target"]), Path(given["--draft"]), Path(given["--out"])
        width = BYTES[given.get("--dtype", "fp16")]
        if target.suffix == ".gguf":   # the files the build reads, as they are on disk
            weights = target.stat().st_size + sum(f.stat().st_size for f in draft.glob("*.safetensors"))
        else:
            weights = (checkpoint_bytes(target, ("model.visual.", "mtp."), width)
                       + checkpoint_bytes(draft, (), width))
        limit = int(args.ratio * weights)
        run, wall, peak, hits = limited([sys.executable, "-m", "export", "build", *flags], limit)
        written = sum(f.stat().st_size for f in out.glob("*.onnx.data")) if out.is_dir() else 0
        report = {"build": " ".join(flags), "completed": run.returncode == 0, "wall_s": round(wall),
                  "checkpoint_weights_gb": round(weights / 1e9, 2), "limit_gb": round(limit / 1e9, 2),
                  "written_gb": round(written / 1e9, 2),
                  "limit_over_written": round(limit / written, 2) if written else None,
                  "cgroup_peak_gb": round(peak / 1e9, 2), "times_at_limit": hits}
    print(json.dumps(report, indent=1))
    if run.returncode:
        sys.exit(f"the run failed (exit {run.returncode}):\n{run.stderr[-3000:]}")


if __name__ == "__main__":
    main()
