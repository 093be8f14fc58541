"""Two builds of the compiled CPU kernels (``plugins/cpu``) on one engine, in one process: the
target step at 1 and ``k + 1`` rows and the draft step, each library's calls interleaved round by
round (which goes first alternates), so that a slow spell of a shared machine falls on both; and
whether they give the same logits, bit for bit.

    python scripts/cpu_library_compare.py --engine engines/smollm2-135m-instruct \\
        --old ~/.cache/dspark-trt/libdspark_cpu-OLD.so --new ~/.cache/dspark-trt/libdspark_cpu-NEW.so

A library is built per source and machine (``plugins/cpu/build.py`` names it by a hash of both):
build the old one, change the sources, build again (``python -m plugins.cpu.build``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import runtime.backends.ort as ort_backend  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--old", type=Path, required=True, help="the library before the change")
    p.add_argument("--new", type=Path, required=True, help="the library after it")
    p.add_argument("--context", type=int, default=128, help="cached rows before each timed step")
    p.add_argument("--rounds", type=int, default=80)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    for path in (args.old, args.new):
        if not path.is_file():
            sys.exit(f"{path}: no such library (python -m plugins.cpu.build prints the one it builds)")
    torch.set_num_threads(ort_backend.OrtBackend.host_threads)
    steps = {name: _steps(_backend(args.engine, path, args.threads), args.context)
             for name, path in (("old", args.old), ("new", args.new))}
    times = {(name, step): [] for name in steps for step in steps[name]}
    for round_ in range(args.rounds + 3):   # the first rounds warm up, untimed
        for name in ("old", "new") if round_ % 2 else ("new", "old"):
            for step, call in steps[name].items():
                began = time.perf_counter()
                call()
                if round_ >= 3:
                    times[name, step].append(time.perf_counter() - began)
    print(f"medians of {args.rounds} interleaved rounds, {args.threads} threads, {args.context} cached rows")
    for step in steps["old"]:
        old, new = (statistics.median(times[name, step]) * 1e3 for name in ("old", "new"))
        print(f"  {step:22s} old {old:7.3f} ms  new {new:7.3f} ms  new/old {new / old:.3f}")
    same = all(torch.equal(steps["old"][step]()[0], steps["new"][step]()[0]) for step in steps["old"])
    print(f"the same outputs, bit for bit: {same}")


def _backend(engine: str, library: Path, threads: int) -> ort_backend.OrtBackend:
    """A backend whose sessions load ``library`` as the compiled kernels."""
    ort_backend.library = lambda: library
    backend = ort_backend.OrtBackend(engine, threads=threads)
    if not backend.batched:
        sys.exit(f"{engine}: its target does not run on the compiled kernels here")
    backend.start(1)
    return backend


def _steps(backend: ort_backend.OrtBackend, context: int) -> dict:
    """The target step at 1 and ``k + 1`` rows and the draft step after a one-row verify, in one
    slot after a prefill of ``context`` random tokens (the caches are not advanced: each call is
    the same)."""
    generator = torch.Generator().manual_seed(0)
    draft, rows = backend.manifest["draft"], backend.limits.k + 1
    prompt = torch.randint(draft["target_vocab_size"], (1, context), generator=generator)
    last, start, state = torch.tensor([[context - 1]]), torch.tensor([context]), torch.tensor([0])
    _, aux = backend.target_step(prompt, torch.tensor([0]), last, state, last, slots=[0])
    ids = torch.randint(draft["target_vocab_size"], (1, rows), generator=generator)
    positions = torch.arange(rows)[None]
    feeds = (aux[:, -1:], torch.tensor([context - 1]), torch.tensor([1]), prompt[:, -1], torch.ones(1),
             torch.zeros(1, draft["k"], draft["draft_vocab_size"]))
    return {f"target, {rows} rows": lambda: backend.target_step(ids, start, positions, state, positions,
                                                                slots=[0]),
            "draft": lambda: backend.draft_step(*feeds, slots=[0]),
            "target, 1 row": lambda: backend.target_step(ids[:, :1], start, positions[:, :1], state,
                                                         positions[:, :1], slots=[0])}


if __name__ == "__main__":
    main()
