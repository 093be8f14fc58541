"""What a verify row costs on this machine: the target step's time at each row count and batch
size, and the draft step's, through the runtime's own backend (caches bound in place, as
``generate`` runs it: a batch in one call where the compiled kernels run it, else one call per
sequence with a one-row step run as two rows), in interleaved rounds so that a slow spell of a
shared machine falls on all row counts alike. Speculation pays where a row costs less than the tokens it is
expected to add: its acceptance times a one-token step.

    python scripts/row_cost.py --engine engines/demo [engines/other ...] --rows 1 2 3 4 5 \\
        [--batch 1 2 4] [--stock] [--portable]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.backends.ort import OrtBackend  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", nargs="+", required=True, help="one or more, timed interleaved")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="sequences per step")
    p.add_argument("--context", type=int, default=128, help="cached rows before each timed step")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--stock", action="store_true",
                   help="also time the quantized layers on ONNX Runtime's own kernels (interleaved)")
    p.add_argument("--portable", action="store_true",
                   help="also time the graphs as the engine holds them, not lowered (interleaved)")
    args = p.parse_args()
    torch.set_num_threads(OrtBackend.hints.host_threads)
    forms = ("lowered", *(("stock",) if args.stock else ()), *(("portable",) if args.portable else ()))
    backends = {(engine, form): OrtBackend(engine, threads=args.threads, lower=form != "portable",
                                           kernel=form == "lowered")
                for engine in args.engine for form in forms}
    capacity = min(backend.limits.capacity for backend in backends.values())
    if args.context + max(args.rows) > capacity or min(args.rows) < 1:
        sys.exit(f"--rows / --context: expected 1 <= rows and context + rows <= the engines' "
                 f"capacity {capacity}")
    most = min(backend.limits.max_batch for backend in backends.values())
    if min(args.batch) < 1 or max(args.batch) > most:
        sys.exit(f"--batch: expected 1 .. {most} (the engines' --max-batch)")
    steps = {}
    for key, backend in backends.items():
        for name, step in timed_steps(backend, args.rows, sorted(set(args.batch)), args.context).items():
            steps[(*key, *name) if isinstance(name, tuple) else (*key, name)] = step
    times = {name: [] for name in steps}
    for round_ in range(args.rounds + 3):   # the first rounds warm up, untimed
        for name, (before, step) in steps.items():
            before()
            began = time.perf_counter()
            step()
            if round_ >= 3:
                times[name].append(time.perf_counter() - began)
    ms = {name: statistics.median(samples) * 1e3 for name, samples in times.items()}
    print(f"median of {args.rounds} interleaved rounds, {args.threads} threads, {args.context} cached rows")
    for (engine, form), backend in backends.items():
        print(f"{engine}, {FORMS[form]}{'' if backend.batched else ', one call per sequence'}:")
        one = ms[engine, form, 1, min(args.rows)]
        for batch in sorted(set(args.batch)):
            previous = None
            for rows in sorted(set(args.rows)):
                label = f"{batch} x {rows} row{'s' if rows > 1 else ''}"
                label += " (run as 2)" if rows == 1 and not backend.batched else ""
                step = ms[engine, form, batch, rows]
                line = f"  target, {label:20s} {step:7.2f} ms  {step / one:5.2f}x"
                if previous is not None:
                    extra = (step - ms[engine, form, batch, previous]) / (rows - previous)
                    line += f"  (+{extra:.2f} ms a row)"
                print(line)
                previous = rows
        for batch in sorted(set(args.batch)):
            after_target, again = ms[engine, form, "draft", batch], ms[engine, form, "draft again", batch]
            print(f"  draft step, {batch} x 1 context row {after_target:10.2f} ms after a target call, "
                  f"{again:.2f} ms right after itself")


FORMS = {"lowered": "lowered (the compiled kernels where built)", "stock": "lowered, ONNX Runtime's kernels",
         "portable": "portable graphs"}


def timed_steps(backend: OrtBackend, rows: list[int], batches: list[int], context: int) -> dict:
    """``(before, step)`` pairs, ``step`` a call timed right after an untimed ``before``:
    ``backend``'s target step at each (batch, row count) and its draft step at each batch, after a
    prefill of ``context`` random tokens in each slot (the caches are not advanced: each call is
    the same). The draft step is timed twice: after a one-row target call, as it runs when decoding
    (the target's weights have pushed its own out of the caches), and after itself."""
    generator = torch.Generator().manual_seed(0)
    draft = backend.manifest["draft"]
    vocab = draft["target_vocab_size"]
    backend.start(max(batches))
    last = torch.tensor([[context - 1]])
    for slot in range(max(batches)):   # a hybrid's state: state slot 0
        prompt = torch.randint(vocab, (1, context), generator=generator)
        _, aux = backend.target_step(prompt, torch.tensor([0]), last, torch.tensor([0]), last, slots=[slot])

    def target(batch: int, count: int):
        """A verify step (every row's logits; a hybrid's state after every row) up to k + 1 rows,
        a prefill chunk's rows beyond (a hybrid keeps only the last row's state)."""
        ids = torch.randint(vocab, (batch, count), generator=generator)
        positions = torch.arange(count)[None].repeat(batch, 1)
        kept = positions if count <= backend.limits.k + 1 else positions[:, -1:]
        start, state = torch.full((batch,), context), torch.zeros(batch, dtype=torch.long)
        return lambda: backend.target_step(ids, start, positions, state, kept, slots=list(range(batch)))

    def draft_step(batch: int):
        """A draft step after a one-row verify, the same in each of ``batch`` slots."""
        feeds = (aux[:, -1:], torch.tensor([context - 1]), torch.tensor([1]), prompt[:, -1], torch.ones(1),
                 torch.zeros(1, draft["k"], draft["target_vocab_size"]))
        feeds = [feed.repeat(batch, *[1] * (feed.dim() - 1)) for feed in feeds]
        return lambda: backend.draft_step(*feeds, slots=list(range(batch)))

    steps = {(batch, count): (nothing, target(batch, count))
             for batch in batches for count in sorted(set(rows))}
    for batch in batches:
        draft_call = draft_step(batch)
        steps["draft", batch] = target(batch, 1), draft_call
        steps["draft again", batch] = draft_call, draft_call
    return steps


def nothing() -> None:
    pass


if __name__ == "__main__":
    main()
