"""Two builds of the compiled CPU kernels (``plugins/cpu``) on one engine: the target step at 1
and ``k + 1`` rows and the draft step (``row_cost.py``'s calls), each library's calls interleaved
round by round in one process (which goes first alternates), so that a slow spell of a shared
machine falls on both; and whether they give the same outputs, bit for bit. The backend made
second in a process ran ~3% faster with the same library (2026-12-06), so it runs twice, each
library's backend made first once, and reports both runs' ratios and their geometric mean.

    python scripts/cpu_library_compare.py --engine engines/smollm2-135m-instruct \\
        --old ~/.cache/dspark-trt/libdspark_cpu-OLD.so --new ~/.cache/dspark-trt/libdspark_cpu-NEW.so

A library is built per source and machine (``plugins/cpu/build.py`` names it by a hash of both):
build the old one, change the sources, build again (``python -m plugins.cpu.build``).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from row_cost import timed_steps  # noqa: E402

import runtime.backends.ort as ort_backend  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--old", type=Path, required=True, help="the library before the change")
    p.add_argument("--new", type=Path, required=True, help="the library after it")
    p.add_argument("--context", type=int, default=128, help="cached rows before each timed step")
    p.add_argument("--rounds", type=int, default=80)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--first", choices=("old", "new"), help=argparse.SUPPRESS)   # one of the two runs
    args = p.parse_args()
    for path in (args.old, args.new):
        if not path.is_file():
            sys.exit(f"{path}: no such library (python -m plugins.cpu.build prints the one it builds)")
    if args.first is None:
        _both_orders(args)
        return
    torch.set_num_threads(ort_backend.OrtBackend.hints.host_threads)
    order = ("old", "new") if args.first == "old" else ("new", "old")
    steps = {name: _steps(_backend(args.engine, getattr(args, name), args.threads), args.context)
             for name in order}
    times = {(name, step): [] for name in steps for step in steps[name]}
    for round_ in range(args.rounds + 3):   # the first rounds warm up, untimed
        for name in order if round_ % 2 else order[::-1]:
            for step, (before, call) in steps[name].items():
                before()
                began = time.perf_counter()
                call()
                if round_ >= 3:
                    times[name, step].append(time.perf_counter() - began)
    medians = {step: [statistics.median(times[name, step]) * 1e3 for name in ("old", "new")]
               for step in steps["old"]}
    same = all(torch.equal(steps["old"][step][1]()[0], steps["new"][step][1]()[0]) for step in steps["old"])
    print(json.dumps({"medians_ms": medians, "same": same}))


def _both_orders(args) -> None:
    """This script once with each library's backend made first, and the ratios of both."""
    runs = []
    for first in ("old", "new"):
        command = [sys.executable, __file__, *sys.argv[1:], "--first", first]
        runs.append(json.loads(subprocess.run(command, capture_output=True, text=True,
                                              check=True).stdout.strip().splitlines()[-1]))
    print(f"medians of {args.rounds} interleaved rounds, {args.threads} threads, {args.context} cached "
          f"rows; new/old with the old library's backend made first, then the new one's")
    for step in runs[0]["medians_ms"]:
        ratios = [new / old for old, new in (run["medians_ms"][step] for run in runs)]
        olds = ", ".join(f"{run['medians_ms'][step][0]:.3f}" for run in runs)
        news = ", ".join(f"{run['medians_ms'][step][1]:.3f}" for run in runs)
        print(f"  {step:26s} old {olds} ms  new {news} ms  new/old {ratios[0]:.3f}, {ratios[1]:.3f}"
              f"  (geometric mean {math.sqrt(ratios[0] * ratios[1]):.3f})")
    print(f"the same outputs, bit for bit: {all(run['same'] for run in runs)}")


def _backend(engine: str, library: Path, threads: int) -> ort_backend.OrtBackend:
    """A backend whose sessions load ``library`` as the compiled kernels."""
    ort_backend.library = lambda: library
    backend = ort_backend.OrtBackend(engine, threads=threads)
    if not backend.batched:
        sys.exit(f"{engine}: its target does not run on the compiled kernels here")
    return backend


def _steps(backend: ort_backend.OrtBackend, context: int) -> dict:
    """``row_cost.timed_steps`` at 1 and ``k + 1`` rows of one sequence, named for the report."""
    rows = backend.limits.k + 1
    names = {(1, 1): "target, 1 row", (1, rows): f"target, {rows} rows",
             ("draft", 1): "draft after a target call", ("draft again", 1): "draft again"}
    return {names[key]: step for key, step in timed_steps(backend, [1, rows], [1], context).items()}


if __name__ == "__main__":
    main()
