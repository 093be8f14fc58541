"""A release-shaped pair against llama.cpp's own tools, on the same GGUF file, in interleaved rounds:
target-only decode after ``--context`` cached rows and prefill of a 512-token chunk, each engine's
speculative step at full verification (every one of ``k`` drafts verified, no confidence cut), and
our target step at 1 .. k + 1 rows and our draft step.

The pair is random (``make-tiny --preset``), so no draft is accepted: a full-verification step then
emits one token, and its tokens/s is its steps/s, the price of a step. ``--tau`` turns that price into
a projection with a published acceptance (tokens per step, the bonus token counted), and
``--survival`` (a published chance per position) gives the best cap's bound at our measured costs.
Ratios are taken round by round, both sides from the same spell of the machine, then their median.

    python scripts/release_shapes.py --preset qwen3-0.6b [--layers N] --work pairs/qwen3-0.6b \
        [--quant q4_0|q4_k_m] [--context 512] [--rounds 3] [--markov-top-k 128]

makes what is missing in ``--work``: the pair (``make-tiny --preset``), the target as llama.cpp's
converter and ``llama-quantize`` write it (``--quant``: Q4_0 with its embedding / output Q8_0, or
Q4_K_M), the draft as its converter writes it, and our engine built from that same file (``build
--target T.gguf``, which keeps its blocks); ``--engine E --gguf T.gguf --draft-gguf D.gguf``
measures ones made otherwise. Our figures come from this process's ONNX Runtime backend,
llama.cpp's from ``llama-bench`` (target-only) and ``llama-server`` (its DSpark,
``bench/llama_cpp_baseline.py``).
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
CAPACITY = 4096   # the engines --preset builds: contexts up to 3520 before a prefill chunk
# --quant: llama-quantize's type and flags
QUANTS = {"q4_0": ("--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0"), "q4_k_m": ()}
# DSpark Qwen3-8B, T = 0, GSM8K, K = 7: the chance that drafts 1..i are all accepted (vllm-ascend #11765)
SURVIVAL = (0.94, 0.87, 0.81, 0.74, 0.69, 0.63, 0.59)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", help="make the pair in --work: a make-tiny --preset name")
    p.add_argument("--layers", type=int, help="the preset's first N layers (make-tiny --layers)")
    p.add_argument("--work", type=Path, help="the folder the pair, its GGUF files and the engine are made in")
    p.add_argument("--markov-top-k", type=int, default=128, help="the engine's (build --markov-top-k) [128]")
    p.add_argument("--quant", choices=sorted(QUANTS), default="q4_0",
                   help="the target file --preset makes with llama-quantize: q4_0 (its embedding / output "
                        "q8_0) or q4_k_m, what users download [q4_0]")
    p.add_argument("--engine", type=Path, help="or an engine made otherwise, with --gguf and --draft-gguf")
    p.add_argument("--gguf", type=Path, help="the target GGUF file the engine was built from")
    p.add_argument("--draft-gguf", type=Path, help="the draft, converted by llama.cpp's converter")
    p.add_argument("--context", type=int, default=512, help="cached rows before each decode step")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tau", type=float, nargs="*", default=[6.27, 3.64],
                   help="published tokens per step to project with (Qwen3-8B GSM8K T=0; MT-Bench)")
    p.add_argument("--survival", type=float, nargs="*", default=list(SURVIVAL),
                   help="a published chance that drafts 1..i are all accepted, for the best cap's bound "
                        "[DSpark Qwen3-8B, T = 0, GSM8K, K = 7]")
    p.add_argument("--out", type=Path, help="write the figures as JSON")
    args = p.parse_args()
    built = tools()
    if args.preset:
        if args.work is None:
            sys.exit("--preset: needs --work, the folder to make the pair in")
        args.engine, args.gguf, args.draft_gguf = prepare(built, args)
    elif None in (args.engine, args.gguf, args.draft_gguf):
        sys.exit("expected --preset NAME --work DIR, or --engine, --gguf and --draft-gguf")
    backend = OrtBackend(args.engine, threads=args.threads)
    k = backend.limits.k
    if args.context + PREFILL > backend.limits.capacity:
        sys.exit(f"--context {args.context}: the engine holds {backend.limits.capacity} positions, "
                 f"expected at most {backend.limits.capacity - PREFILL}")
    steps = timed_steps(backend, list(range(1, k + 2)) + [PREFILL], [1], args.context)
    vocab = backend.manifest["draft"]["target_vocab_size"]
    prompt = torch.randint(vocab, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    samples: dict[str, list[float]] = {}
    for round_ in range(args.rounds + 1):   # the first round warms up, untimed
        figures = {**_ours(steps), **_our_full_verification(backend, prompt),
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
    ratios = _print(report, samples, args, k)
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "engine": str(args.engine),
                                        "gguf": str(args.gguf), "draft_gguf": str(args.draft_gguf),
                                        "context": args.context, "k": k, "threads": args.threads,
                                        "figures": report, "ratios": ratios, "samples": samples}, indent=1))


def prepare(built, args) -> tuple[Path, Path, Path]:
    """``(engine, target GGUF, draft GGUF)`` of ``--preset`` in ``--work``, each made where missing."""
    from bench.llama_cpp_tools import convert_draft
    from modeling.fixtures.presets import make_preset

    work = args.work
    pair, engine = work / "pair", work / f"engine-{args.quant}-top{args.markov_top_k}"
    target, draft = pair / "target", pair / "draft"
    if not (draft / "config.json").exists():
        make_preset(pair, args.preset, layers=args.layers)
    gguf, draft_gguf = work / f"target-{args.quant}.gguf", work / "draft-f16.gguf"
    if not gguf.exists():
        f16 = built.convert(target, work / "target-f16.gguf", pre_tokenizer="qwen2")
        built.quantize_file(f16, gguf, args.quant, *QUANTS[args.quant])
        f16.unlink()
    if not draft_gguf.exists():
        convert_draft(draft, target, draft_gguf, pre_tokenizer="qwen2")
    if not (engine / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "export", "build", "--target", str(gguf), "--draft", str(draft),
                        "--markov-top-k", str(args.markov_top_k), "--max-batch", "1", "--max-seq-len",
                        str(CAPACITY), "--out", str(engine), "--quiet", "--force"],
                       check=True, cwd=Path(__file__).resolve().parents[1])
    return engine, gguf, draft_gguf


def _ours(steps: dict, calls: int = 3) -> dict[str, float]:
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
        if name[0] in ("draft", "draft again"):   # after a one-row target call, and after itself
            out[f"ours {name[0]} step ms"] = seconds * 1e3
        elif name[-1] == PREFILL:
            out["ours prefill tok/s"] = PREFILL / seconds
        else:
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


def _print(report: dict, samples: dict[str, list[float]], args, k: int) -> dict:
    """The figures, then the ratios each round gives (both sides from the same spell of the
    machine), as their median and range; returns the ratios."""
    print(f"median of {args.rounds} interleaved rounds [min, max], {args.threads} threads, context "
          f"{args.context}, k = {k}")
    for name, figure in report.items():
        print(f"  {name:40s} {figure['median']:9.2f}  [{figure['min']:.2f}, {figure['max']:.2f}]")
    rounds = [dict(zip(samples, values)) for values in zip(*samples.values())]
    per_round = {
        "target-only decode, ours / llama.cpp":
            lambda r: r["ours target-only tok/s"] / r["llama.cpp target-only tok/s"],
        "prefill, ours / llama.cpp": lambda r: r["ours prefill tok/s"] / r["llama.cpp prefill tok/s"],
        "our full-verification step / our target-only step":
            lambda r: r["ours target-only tok/s"] / r["ours full-verification steps/s"],
        "llama.cpp's full-verification step / its target-only step":
            lambda r: r["llama.cpp target-only tok/s"] / r["llama.cpp full-verification steps/s"],
        "full-verification steps/s, ours / llama.cpp's":
            lambda r: r["ours full-verification steps/s"] / r["llama.cpp full-verification steps/s"],
        # a projection: the measured price of a step times a published acceptance (tokens a step)
        **{f"projected at tau {tau}, ours / llama.cpp target-only":
           (lambda r, tau=tau: tau * r["ours full-verification steps/s"] / r["llama.cpp target-only tok/s"])
           for tau in args.tau}}
    if len(args.survival) >= k:   # the best cap at our measured costs and that acceptance
        per_round["best cap's bound at the survival profile, ours / llama.cpp target-only"] = \
            lambda r: _bound(r, args.survival, k)[1] / r["llama.cpp target-only tok/s"]
        cap, rate = _bound({name: figure["median"] for name, figure in report.items()}, args.survival, k)
        print(f"  the best cap at the survival profile {args.survival[:k]}: {cap} drafts, {rate:.1f} tok/s "
              f"(steps priced as measured: the target's rows and the draft step, the host's work left out)")
    ratios = {}
    for name, ratio in per_round.items():
        values = sorted(ratio(r) for r in rounds)
        ratios[name] = {"median": statistics.median(values), "min": values[0], "max": values[-1]}
        print(f"  {name:58s} {ratios[name]['median']:5.2f}x [{values[0]:.2f}, {values[-1]:.2f}]")
    return ratios


def _bound(figures: dict[str, float], survival: list[float], k: int) -> tuple[int, float]:
    """``(cap, tokens/s)`` of the cap with the most expected tokens per second: ``1 + survival[:cap]``
    tokens for a target call of ``cap + 1`` rows and, with drafts, a draft call."""
    def rate(cap: int) -> float:
        seconds = figures[f"ours target {cap + 1} rows ms"] + (figures["ours draft step ms"] if cap else 0)
        return (1 + sum(survival[:cap])) / seconds * 1e3

    cap = max(range(k + 1), key=rate)
    return cap, rate(cap)


if __name__ == "__main__":
    main()
