"""A release-shaped pair against llama.cpp's own tools, on the same GGUF file, in interleaved rounds:
target-only decode after ``--context`` cached rows and prefill of a 512-token chunk, each engine's
speculative step at full verification (every one of ``k`` drafts verified, no confidence cut), and
our target step by rows and our draft step.

The pair is random (``make-tiny --preset``), so no draft is accepted: a full-verification step then
emits one token, and its tokens/s is its steps/s, the price of a step. ``--tau`` turns that price into
a projection with a published acceptance (tokens per step, the bonus token counted).

    python scripts/release_shapes.py --engine engines/qwen3-0.6b --gguf T.gguf --draft-gguf D.gguf \\
        [--context 512] [--rounds 3] [--tau 6.27 3.64]

``T.gguf`` is the file the engine was built from (``build --target T.gguf --weights gguf``), and
``D.gguf`` the draft as llama.cpp's converter writes it (``bench/llama_cpp_tools.py``). Our figures
come from this process's ONNX Runtime backend, llama.cpp's from ``llama-bench`` (target-only) and
``llama-server`` (its DSpark: ``--spec-type draft-dspark --spec-draft-n-max k --spec-draft-n-min k``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from row_cost import timed_steps  # noqa: E402

from bench.llama_cpp_baseline import LlamaServer  # noqa: E402
from bench.llama_cpp_tools import tools  # noqa: E402
from runtime.backends.ort import OrtBackend  # noqa: E402
from runtime.decoding.batch import generate  # noqa: E402

NEW_TOKENS = 48
PREFILL = 512


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True)
    p.add_argument("--gguf", type=Path, required=True,
                   help="the target GGUF file the engine was built from")
    p.add_argument("--draft-gguf", type=Path, required=True,
                   help="the draft, converted by llama.cpp's converter")
    p.add_argument("--context", type=int, default=512, help="cached rows before each decode step")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tau", type=float, nargs="*", default=[6.27, 3.64],
                   help="published tokens per step to project with (Qwen3-8B GSM8K T=0; MT-Bench)")
    p.add_argument("--out", type=Path, help="write the figures as JSON")
    args = p.parse_args()
    built = tools()
    backend = OrtBackend(args.engine, threads=args.threads)
    k = backend.limits.k
    if args.context + PREFILL > backend.limits.capacity:
        sys.exit(f"--context {args.context}: the engine holds {backend.limits.capacity} positions, "
                 f"expected at most {backend.limits.capacity - PREFILL}")
    rows = sorted({1, 2, 4, k + 1})
    steps = timed_steps(backend, rows + [PREFILL], [1], args.context)
    vocab = backend.manifest["draft"]["target_vocab_size"]
    prompt = torch.randint(vocab, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    samples: dict[str, list[float]] = {}
    for round_ in range(args.rounds + 1):   # the first round warms up, untimed
        figures = {**_ours(steps, rows, k), **_our_full_verification(backend, prompt),
                   **_llama_bench(built, args)}
        # the server runs only for its own figure: its idle threads poll for work, taking a core
        context = args.context + NEW_TOKENS + 64
        with LlamaServer(args.gguf, args.threads, context, args.draft_gguf, k) as server:
            figures.update(_llama_dspark(server, prompt))
        if round_:
            for name, value in figures.items():
                samples.setdefault(name, []).append(value)
        print(f"round {round_}{' (warm-up)' if not round_ else ''}: "
              + ", ".join(f"{name} {value:.2f}" for name, value in figures.items()), file=sys.stderr)
    report = {name: {"median": statistics.median(v), "min": min(v), "max": max(v)}
              for name, v in samples.items()}
    _print(report, args, k)
    if args.out:
        args.out.write_text(json.dumps({"engine": str(args.engine), "gguf": str(args.gguf),
                                        "context": args.context, "k": k, "figures": report}, indent=1))


def _ours(steps: dict, rows: list[int], k: int, calls: int = 3) -> dict[str, float]:
    """Our target step at each row count and the draft step (ms, the median of ``calls``), and
    prefill tokens/s."""
    out = {}
    for name, (before, step) in steps.items():
        times = []
        for _ in range(calls):
            before()
            began = time.perf_counter()
            step()
            times.append(time.perf_counter() - began)
        seconds = statistics.median(times)
        if name == "draft" or (isinstance(name, tuple) and name[0] == "draft"):
            out["ours draft step ms"] = seconds * 1e3
        elif name[-1] == PREFILL:
            out["ours prefill tok/s"] = PREFILL / seconds
        elif name[-1] in rows:
            out[f"ours target {name[-1]} rows ms"] = seconds * 1e3
    return out


def _our_full_verification(backend: OrtBackend, prompt: list[int]) -> dict[str, float]:
    """Target-only and full-verification decoding through the loop (host work included), tokens/s."""
    out = {}
    for name, speculative in (("ours target-only tok/s", False), ("ours full-verification steps/s", True)):
        result = generate(backend, [prompt], max_new_tokens=NEW_TOKENS, speculative=speculative,
                          confidence_threshold=0.0)
        # the first token is the prefill's; with nothing accepted, a speculative step emits one token
        out[name] = (len(result.token_ids[0]) - 1) / (result.times.total - result.times.prefill)
    return out


def _llama_bench(built, args) -> dict[str, float]:
    command = [str(built.bench), "-m", str(args.gguf), "-t", str(args.threads), "-r", "1", "-o", "json",
               "-p", str(PREFILL), "-n", str(NEW_TOKENS), "-d", str(args.context)]
    records = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    return {("llama.cpp prefill tok/s" if r["n_prompt"] else "llama.cpp target-only tok/s"): r["avg_ts"]
            for r in records}


def _llama_dspark(server: LlamaServer, prompt: list[int]) -> dict[str, float]:
    """llama.cpp's DSpark decoding ``prompt`` (the second of two requests: the first pages its
    weights in), steps/s: with nothing accepted, its tokens/s."""
    for _ in range(2):
        run = server.generate(prompt, NEW_TOKENS, stop=None)
    steps = len(run["token_ids"]) - 1   # the first token is the prompt's
    return {"llama.cpp full-verification steps/s": steps / run["decode_seconds"],
            "llama.cpp drafts a step": run["drafted"] / steps}


def _print(report: dict, args, k: int) -> None:
    print(f"median of {args.rounds} interleaved rounds [min, max], {args.threads} threads, context "
          f"{args.context}, k = {k}")
    for name, figure in report.items():
        print(f"  {name:40s} {figure['median']:9.2f}  [{figure['min']:.2f}, {figure['max']:.2f}]")
    ours, theirs = report["ours target-only tok/s"]["median"], report["llama.cpp target-only tok/s"]["median"]
    full = report["ours full-verification steps/s"]["median"]
    their_full = report["llama.cpp full-verification steps/s"]["median"]
    print(f"  target-only decode, ours / llama.cpp: {ours / theirs:.2f}x; prefill: "
          f"{report['ours prefill tok/s']['median'] / report['llama.cpp prefill tok/s']['median']:.2f}x")
    print(f"  a full-verification step costs {ours / full:.2f} of our target-only steps "
          f"(llama.cpp's: {theirs / their_full:.2f} of its own)")
    for tau in args.tau:   # a projection: the measured price of a step times a published acceptance
        print(f"  projected at tau {tau}: ours {full * tau:.1f} tok/s = {full * tau / theirs:.2f}x llama.cpp "
              f"target-only, {full / their_full:.2f}x llama.cpp's DSpark")


if __name__ == "__main__":
    main()
