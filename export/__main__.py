"""``python -m export``: the command line of the export side. Each command imports what it runs
(torch, onnx, ...) when it runs, so that ``--help`` and flag errors come at once."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.cli_parser import Parser
from common.errors import run_command
from common.outputs import check_replaceable, staged_directory
from export import build_checks
from modeling.fixtures.presets import PRESETS
from modeling.fixtures.tiny import ARCHS
from modeling.layouts import LAYOUTS

TINY_SHAPE = ("arch", "draft_format", "draft_vocab", "layout", "block_size")   # make-tiny's shape flags
# what Ctrl-C leaves behind: outputs are staged beside OUT / --out and swapped in only when complete
UNCHANGED = "no output was changed"


def cmd_make_tiny(args: argparse.Namespace) -> None:
    from modeling.fixtures.presets import make_preset
    from modeling.fixtures.tiny import TinySpec, make_tiny

    out = Path(args.out)
    shape_flags = {name: value for name in TINY_SHAPE if (value := getattr(args, name)) is not None}
    if args.preset:
        if shape_flags:
            given = ", ".join("--" + name.replace("_", "-") for name in shape_flags)
            raise ValueError(f"--preset {args.preset}: a preset fixes every shape; leave out {given}")
        def write(directory):
            return make_preset(directory, args.preset, seed=args.seed, layers=args.layers)
        sliced = f", its first {args.layers} layers" if args.layers else ""
        described = (f"{args.preset}-shaped target (random bf16 weights, sharded{sliced})",
                     "release-shaped native DSpark draft (5 layers, block 7)")
    else:
        if args.layers is not None:
            raise ValueError("--layers: slices a --preset's target; the tiny pair has 4 layers")
        spec = TinySpec(**shape_flags, seed=args.seed)

        def write(directory):
            return make_tiny(directory, spec)
        described = (f"tiny {spec.arch} target", f"tiny {spec.draft_format} DSpark draft ({spec.layout})")
    check_replaceable(out, args.force, "OUT")
    with staged_directory(out, "OUT") as staging:
        write(staging)
    print(f"wrote {described[0]} to {out / 'target'}\nwrote {described[1]} to {out / 'draft'}")


def check_build(args: argparse.Namespace) -> tuple[Path, str | None]:
    """``build``'s flags, the demo pair's defaults filled in, and its paths, checked before
    anything loads (``build_checks``: no torch, transformers or onnx): ``(out, where k came
    from)``, or one line on the first mistake."""
    from modeling.checkpoint import local, resolve

    if (args.target is None) != (args.draft is None):
        raise ValueError("pass both --target and --draft, or neither for the built-in demo pair")
    k_origin = None if args.k is None else f"--k {args.k}"
    if args.target is None:
        from modeling import demo_pair

        args.target, args.draft = str(demo_pair.target()), str(demo_pair.draft())
        if args.k is None:
            args.k, k_origin = demo_pair.K, "the demo pair's default"
        if args.confidence_threshold is None:
            args.confidence_threshold = demo_pair.CONFIDENCE_THRESHOLD
    if Path(args.target).suffix == ".gguf":   # the demo pair's target is one too
        args.weights, args.quantize_draft = build_checks.gguf_defaults(args.weights, args.quantize_draft,
                                                                       args.dtype)
    build_checks.check_options(
        k=args.k, markov_top_k=args.markov_top_k, confidence_threshold=args.confidence_threshold or 0.0,
        dtype=args.dtype,
        backend=args.backend, gpus=tuple(args.gpu), weights=args.weights, weights_block=args.weights_block,
        quantize_draft=bool(args.quantize_draft), max_batch=args.max_batch, max_seq_len=args.max_seq_len,
        max_prompt_chunk=args.max_prompt_chunk)
    build_checks.check_tensorrt_installed(args.backend)
    out = Path(args.out) if args.out else Path("engines") / Path(args.draft.rstrip("/")).name
    check_replaceable(out, args.force, "--out", sources=(Path(args.target), Path(args.draft)))
    local(args.target, "target")   # a missing path is named target first, before any download
    local(args.draft, "draft")
    # then the draft: a hub id's target is the larger download
    build_checks.check_draft_k(resolve(args.draft, "draft"), args.k)
    if resolve(args.target, "target").suffix != ".gguf" and args.weights == build_checks.GGUF:
        raise ValueError(f"--weights gguf: the target {args.target} is not a .gguf file; use --weights "
                         f"int4 or int8")
    return out, k_origin


def cmd_build(args: argparse.Namespace) -> None:
    out, k_origin = check_build(args)
    # every flag and path was checked above, with nothing loaded: the long work starts only now
    with staged_directory(out, "--out") as staging:
        from common import manifest
        from export.build import build
        from export.onnx_export import BuildLimits

        limits = BuildLimits(max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                             max_prompt_chunk=args.max_prompt_chunk)
        # built beside --out and swapped in once verified: a failed build leaves the old one as it was
        result = build(args.target, args.draft, staging, k=args.k, markov_top_k=args.markov_top_k,
                       limits=limits, confidence_threshold=args.confidence_threshold or 0.0, dtype=args.dtype,
                       opset=args.opset, backend=args.backend, gpus=tuple(args.gpu),
                       weights=args.weights, weights_block=args.weights_block,
                       quantize_draft=bool(args.quantize_draft), progress=not args.quiet)
    print(f"built {out} in {result.seconds:.1f}s")
    # no tensor records the width a draft was trained at, so say where k came from
    draft = manifest.read(out)["draft"]
    origin = k_origin or f"the draft's config.json: block_size {draft['block_size']}, {draft['layout']}"
    print(f"  k = {draft['k']} drafts per step (from {origin})")
    for name, size in result.files.items():
        print(f"  {name:40} {size / 1e6:10.2f} MB")
    if result.quantized_layers:
        print("  quantized linear layers: " + ", ".join(f"{name} {count}" for name, count
                                                         in result.quantized_layers.items()))
        print(f"  weights: {manifest.describe_weights(manifest.read(out))}")
    if None in result.max_difference.values():
        print("  ONNX Runtime vs PyTorch: not run (ONNX Runtime has no bf16 CPU kernels); "
              "onnx.checker and shape inference passed")
    else:
        print("  ONNX Runtime vs PyTorch (max relative difference): "
              + ", ".join(f"{k} {v:.2g}" for k, v in result.max_difference.items()))


def cmd_inspect(args: argparse.Namespace) -> None:
    from common import manifest

    print(manifest.describe(manifest.read(Path(args.engine))))


def cmd_triton_repo(args: argparse.Namespace) -> None:
    from runtime.serving.tritonserver_repo import write_model

    model = write_model(Path(args.engine), Path(args.out), args.name, args.backend, args.instances,
                        args.threads, args.max_queue, args.draft_schedule, args.force)
    print(f"wrote the Triton model {model.name} to {model} (engine {Path(args.engine).resolve()}); serve it "
          f"with `tritonserver --model-repository {args.out}`")


def parser() -> argparse.ArgumentParser:
    root = Parser(prog="python -m export",
                                   description="Export DSpark speculative decoding pairs.")
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tiny = commands.add_parser("make-tiny", help="write a small random target + DSpark draft pair",
                               description="Write OUT/target (a transformers checkpoint with a "
                                           "character tokenizer) and OUT/draft (a DSpark draft), "
                                           "random weights, for tests and demos; with --preset, "
                                           "in the exact shapes of a released model, for scale "
                                           "benchmarks.")
    tiny.add_argument("out", metavar="OUT", help="output directory")
    tiny.add_argument("--preset", choices=list(PRESETS),
                      help="a target of this release's shape (bf16, sharded; the Qwen3.6 ones in the "
                           "ForConditionalGeneration layout) and a draft of DeepSeek's released DSpark "
                           "drafts' shape [the tiny pair]")
    tiny.add_argument("--layers", type=int, metavar="N",
                      help="with --preset: only the target's first N layers, a slice of the release's "
                           "shape that can be built and timed on a small machine [all]")
    tiny.add_argument("--arch", choices=list(ARCHS),
                      help="target architecture (llama ties its embeddings; qwen3_5 is the Qwen3.5 / "
                           "3.6 hybrid, -multimodal in its ForConditionalGeneration layout) [qwen3]")
    tiny.add_argument("--draft-format", choices=["native", "speculators"],
                      help="DeepSpec native config or Speculators config [native]")
    tiny.add_argument("--draft-vocab", type=int, metavar="N",
                      help="reduced draft vocabulary of N ids with a d2t map [the target's]")
    tiny.add_argument("--layout", choices=LAYOUTS,
                      help=f"block layout the draft is declared with [{LAYOUTS[0]}]")
    tiny.add_argument("--block-size", type=int, help="trained block width [4]")
    tiny.add_argument("--seed", type=int, default=0, help="random seed [0]")
    tiny.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    tiny.set_defaults(run=cmd_make_tiny, interrupted=UNCHANGED)

    b = commands.add_parser("build", help="export a target + DSpark draft to an engine directory",
                            description="Trace the target step and the DSpark draft step (block "
                                        "backbone + unrolled Markov sampler) to ONNX, verify them "
                                        "against PyTorch in ONNX Runtime, and write a "
                                        "self-contained engine directory with manifest.json. With "
                                        "neither --target nor --draft it builds the demo pair: "
                                        "SmolLM2-135M-Instruct and its distilled DSpark draft, "
                                        "k = 4 and --confidence-threshold 0.6 unless given.")
    b.add_argument("--target", help="target checkpoint: directory, .gguf file or hub id [the demo "
                                    "pair's SmolLM2-135M-Instruct GGUF]")
    b.add_argument("--draft", help="DSpark draft: directory or hub id [the demo pair's distilled "
                                   "draft, modeling/drafts/smollm2-135m-instruct]")
    b.add_argument("--out", help="engine directory [engines/<draft name>]")
    b.add_argument("--k", type=int, help="drafts per step [the draft's trained number]")
    b.add_argument("--markov-top-k", type=int, default=0, metavar="K",
                   help="each draft's Markov bias and choice over the K largest of its base logits only "
                        "(vLLM's dspark_draft_topk): at a 151936-id vocabulary the full chain reads all of "
                        "markov_w2 once a draft; verification stays exact, the drafts may differ from "
                        "DeepSpec's [0: every draft id]")
    b.add_argument("--confidence-threshold", type=float, metavar="P",
                   help="the runtime's default: verify a step's drafts only up to the first whose "
                        "top draft probability is below P, as transformers' "
                        "assistant_confidence_threshold; 0 verifies all k [0]")
    b.add_argument("--max-batch", type=int, default=4, help="largest batch [4]")
    b.add_argument("--max-seq-len", type=int,
                   help="KV-cache capacity per sequence, prompt + output + one block [2048, or the "
                        "target's max_position_embeddings if smaller]")
    b.add_argument("--max-prompt-chunk", type=int,
                   help="most prompt tokens per prefill call; longer prompts are chunked "
                        "[512 or --max-seq-len if smaller]")
    b.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32",
                   help="weights and activations; norms and softmax accumulate in fp32 [fp32]")
    b.add_argument("--opset", type=int, choices=[23, 24], default=23, help="ONNX opset [23]")
    b.add_argument("--weights", metavar="float|int4|int8|gguf",
                   help="float: the --dtype weights; int4 / int8: quantize the target's linear layers "
                        "(lm_head included), weight-only, symmetric, blockwise round-to-nearest, as "
                        "DequantizeLinear -> MatMul (the build verifies it and states its quality "
                        "cost); gguf: keep a .gguf target's own blocks (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / "
                        "Q4_K / Q5_K / Q6_K), the weights llama.cpp computes "
                        "with [float; a .gguf target: gguf]")
    b.add_argument("--weights-block", type=int, default=32, metavar="N",
                   help="weights per quantization scale, along the input axis (a power of two >= 16) [32]")
    b.add_argument("--quantize-draft", action=argparse.BooleanOptionalAction,
                   help="quantize the draft's linear layers too, as --weights says (int4 beside a gguf "
                        "target: a draft has no GGUF file) [the draft keeps its --dtype weights; beside "
                        "a .gguf target: quantized, unless --weights float]")
    b.add_argument("--backend", choices=build_checks.BACKENDS, default="onnx",
                   help="also build TensorRT (trt) or TensorRT-RTX (trt-rtx) engines with the "
                        "dspark plugins; build those graphs with --dtype fp16 or bf16 [onnx]")
    b.add_argument("--gpu", action="append", default=[], metavar="SM",
                   help="TensorRT-RTX compute capability to build for, without a GPU: sm75, sm80, "
                        "sm86, sm89, sm120, sm121 (repeatable) [sm89]")
    b.add_argument("--force", action="store_true", help="replace a non-empty --out")
    b.add_argument("--quiet", action="store_true", help="no progress line")
    b.set_defaults(run=cmd_build, interrupted=UNCHANGED)

    inspect = commands.add_parser("inspect", help="describe an engine directory",
                                  description="Print an engine directory's manifest in human terms.")
    inspect.add_argument("engine", metavar="DIR", help="engine directory")
    inspect.set_defaults(run=cmd_inspect, interrupted="nothing was written")

    triton = commands.add_parser("triton-repo", help="an engine directory as a Triton Inference Server model",
                                 description="Write OUT/NAME/config.pbtxt and OUT/NAME/1/model.py: a "
                                             "decoupled Python-backend model over ENGINE (referenced, "
                                             "not copied) with the inputs and outputs of Triton's "
                                             "generate extension (text_input, max_tokens, temperature, "
                                             "top_p, random_seed, stop_words, stream -> text_output), "
                                             "continuous batching inside each instance. Other models "
                                             "in OUT are left as they are.")
    triton.add_argument("engine", metavar="ENGINE", help="engine directory")
    triton.add_argument("out", metavar="OUT", help="model repository directory")
    triton.add_argument("--name", help="model name [the engine directory's name]")
    triton.add_argument("--backend", default="ort",
                        help="runtime backend of each instance: ort, torch, or on a GPU (KIND_GPU "
                             "instances) torch-cuda, trt, trt-rtx [ort]")
    triton.add_argument("--instances", type=int, default=1, help="model instances, one backend each [1]")
    triton.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads per instance [all cores]")
    triton.add_argument("--max-queue", type=int, default=64,
                        help="requests an instance holds beyond its slots; more are refused [64]")
    triton.add_argument("--draft-schedule", metavar="BUSY:DRAFTS,...",
                        help="drafts verified per step by busy slots, as runtime.serve's [measured "
                             "when the instance loads]")
    triton.add_argument("--force", action="store_true", help="replace an existing OUT/NAME")
    triton.set_defaults(run=cmd_triton_repo, interrupted="nothing was written")
    return root


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    run_command(lambda: args.run(args), args.interrupted)


if __name__ == "__main__":
    main(sys.argv[1:])
