"""``python -m export build``: checkpoints -> a self-contained engine directory.

The configs and the tokenizer first, then one model at a time (the draft, then the target): load
it, trace it to ONNX, compute the reference outputs, let its PyTorch weights go, then verify the
written graph (checker, shape inference, ONNX Runtime vs those references). The process never holds
both models, nor one model's weights twice, so a build's peak memory stays near the larger model's
weights. Then the engines and the manifest.

With ``--weights int4|int8`` the module's linear weights are replaced by their de-quantized values
before it is traced (after the target's teacher-forced predictions on held-out text are taken, for
the quality cost), and the written graph is rewritten to hold them quantized (``qdq.py``): the
graph is then verified against a reference with exactly its weights. ``--weights gguf`` leaves the
module as ``transformers`` loaded it (the GGUF file's de-quantized values; Q6_K experts, which
the engine rounds again, rounded first) and writes the file's own blocks into the graph
(``gguf_blocks.py``).
"""
from __future__ import annotations

import ctypes
import gc
import platform
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from common import manifest as manifest_file
from export import build_checks, qdq, quantize
from export.gguf_blocks import SUPPORTED, GgufBlocks, unsupported_matrices
from export.onnx_check import VerificationError, check_model, compare_with_reference
from export.onnx_export import (
    DTYPE_NAMES,
    BuildLimits,
    GraphSpec,
    draft_spec,
    export_graph,
    target_spec,
)
from export.quality import QUALITY_MAX_TOKENS, held_out_texts, quality_cost, teacher_forced
from export.verify_inputs import example_inputs, reference_outputs, with_context
from modeling.checkpoint import CheckpointError, gguf_reader, hf_location, resolve
from modeling.dense import TargetStep
from modeling.draft import DraftStep, load_draft, load_draft_lazily
from modeling.draft_config import DraftConfig, load_draft_config
from modeling.lazy_weights import LazyWeights, resident
from modeling.target import load_target, load_target_lazily
from modeling.target_config import TargetConfig
from modeling.target_config_reader import load_target_config
from plugins.block_attention.ort_contrib import target_rotary

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOKENIZER_DIR = "tokenizer"


@dataclass
class BuildResult:
    files: dict[str, int]          # file name -> bytes
    seconds: float
    max_difference: dict[str, float | None]   # None: not run (bf16 has no ORT CPU kernels)
    quantized_layers: dict[str, int]          # graph name -> linear layers quantized
    quality: dict | None                      # quality_cost of the target, when quantized


@dataclass(frozen=True)
class Options:
    """How to build, as ``build`` was asked (checked by ``build_checks``)."""
    k: int | None
    markov_top_k: int
    confidence_threshold: float
    dtype: str
    opset: int
    backend: str
    gpus: tuple[str, ...]
    formats: dict[str, str]       # "target" / "draft" -> quantize.FLOAT, INT4, INT8 or GGUF
    weights_block: int

    @property
    def dtype_name(self) -> str:
        """The manifest's name of ``dtype`` (``DTYPE_NAMES``)."""
        return DTYPE_NAMES[DTYPES[self.dtype]]


@dataclass
class Sources:
    """What ``read`` resolves before any model loads."""
    target_dir: Path
    draft_dir: Path
    target_config: TargetConfig
    draft_config: DraftConfig
    limits: BuildLimits                # the defaults filled in
    tokenizer: PreTrainedTokenizerBase
    described: dict               # the manifest's "source"


@dataclass
class Weights:
    """How a loaded module's weights go into its graph: ``blocks_of`` (and ``embeddings``) give a
    weight's blocks (None: the graph keeps floats); ``count`` the matrices the module has so."""
    count: int = 0
    blocks_of: quantize.BlocksOf | None = None
    embeddings: quantize.BlocksOf | None = None
    gguf: GgufBlocks | None = None
    quality: dict | None = None   # quality_cost of a quantized target


@dataclass
class BlocksIntoGraph:
    """``weights``' blocks into a graph (``qdq``): as ``export_graph`` writes it (``rewrite``), for
    a module of placeholders, whose weights then never reach the disk as floats (an 8B GGUF
    target's were 32.8 GB of float32, written to be read back once); or into the graph written.
    ``count``: the matrices the graph holds so, once done."""
    weights: Weights
    keep: set[str]
    kquant_scales: bool
    count: int | None = None

    def __call__(self, model, path: Path) -> None:
        self.count = qdq.quantize_model(model, path, *self._given())

    def into_written(self, path: Path) -> None:
        self.count = qdq.quantize_graph(path, *self._given())

    def _given(self) -> tuple:
        return self.weights.blocks_of, self.keep, self.weights.embeddings, self.kquant_scales


@dataclass
class Graph:
    """One model's graph, written and verified: what the manifest and the result say of it."""
    described: dict
    spec: GraphSpec
    quantized: int
    difference: float | None
    quality: dict | None


def build(target: str, draft: str, out: Path, *, k: int | None = None, markov_top_k: int = 0,
          limits: BuildLimits, confidence_threshold: float = 0.0, dtype: str = "fp32", opset: int = 23,
          backend: str = "onnx", gpus: tuple[str, ...] = (), weights: str | None = None,
          weights_block: int = 32, quantize_draft: bool = False, progress: bool = True) -> BuildResult:
    """Build into ``out``, which must exist and be empty (the CLI handles ``--force``).
    ``backend`` ``trt`` / ``trt-rtx`` also builds TensorRT engines (for ``gpus``).
    ``confidence_threshold`` is recorded as the runtime's default (``runtime.decoding.batch``).
    ``markov_top_k`` K > 0 draws each draft from its K largest base logits (``DraftStep.sample``).
    ``weights`` (``int4`` / ``int8``) quantizes the target's linear layers in blocks of
    ``weights_block``, and the draft's too with ``quantize_draft``; ``gguf`` keeps a GGUF target's
    own blocks (and ``quantize_draft`` rounds the draft to int4). A ``None`` in ``limits`` is the
    default: ``max_seq_len`` the target's max_position_embeddings, at most 2048; ``max_prompt_chunk``
    512, at most ``max_seq_len``."""
    build_checks.check_options(
        k=k, markov_top_k=markov_top_k, confidence_threshold=confidence_threshold, dtype=dtype,
        backend=backend, gpus=gpus,
        weights=weights, weights_block=weights_block, quantize_draft=quantize_draft,
        max_batch=limits.max_batch, max_seq_len=limits.max_seq_len, max_prompt_chunk=limits.max_prompt_chunk)
    weights = None if weights == quantize.FLOAT else weights
    draft_weights = quantize.GGUF_DRAFT if weights == quantize.GGUF else weights
    options = Options(k, markov_top_k, confidence_threshold, dtype, opset, backend, gpus,
                      {"target": weights or quantize.FLOAT,
                       "draft": draft_weights if quantize_draft else quantize.FLOAT}, weights_block)
    started = time.perf_counter()
    status = Progress(["read configs", "draft", "target",
                       *([f"build {backend} engines"] if backend != "onnx" else []), "write manifest"],
                      enabled=progress)
    try:   # the line is cleared on any way out, so that a message after it starts a line
        status.phase("read configs")
        sources = read(target, draft, out, limits, options)
        graphs: dict[str, Graph] = {}
        inputs = torch.Generator().manual_seed(0)   # both graphs' verification inputs, in turn
        for name in ("draft", "target"):   # the draft first: the smaller model's load errors come early
            # a hybrid target keeps a recurrent-state slot per verify row: k + 1
            slots = graphs["draft"].described["k"] + 1 if name == "target" else 0
            graphs[name] = make_graph(name, sources, options, out, status.phase, slots, inputs)
            release_freed_memory()
        manifest = describe(sources, options, graphs)
        if backend != "onnx":
            status.phase(f"build {backend} engines")
            add_engines(out, manifest, backend, gpus)
        status.phase("write manifest")
        manifest_file.write(out, manifest)
    finally:
        status.close()
    files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    return BuildResult(files, time.perf_counter() - started,
                       {name: graph.difference for name, graph in graphs.items()},
                       {name: graph.quantized for name, graph in graphs.items()
                        if options.formats[name] != quantize.FLOAT}, graphs["target"].quality)


def read(target: str, draft: str, out: Path, limits: BuildLimits, options: Options) -> Sources:
    """Resolve both checkpoints, read their configs and refuse what cannot be built, before any
    weights load; the tokenizer (and generation config) copied into ``out``."""
    target_dir, draft_dir = resolve(target, "target"), resolve(draft, "draft")
    if options.formats["target"] == quantize.GGUF:
        _check_gguf_weights(target, target_dir)
    target_config = load_target_config(target_dir)
    limits = _with_defaults(limits, target_config.max_position_embeddings)
    decoder = target_config.decoder
    draft_config = load_draft_config(draft_dir, decoder.num_layers, decoder.hidden_size)
    described = {"target": _source(target, target_dir), "draft": _source(draft, draft_dir)}
    tokenizer = _save_tokenizer(target_dir, out / TOKENIZER_DIR)
    _save_generation_config(target_dir, out)
    return Sources(target_dir, draft_dir, target_config, draft_config, limits, tokenizer, described)


def make_graph(name: str, sources: Sources, options: Options, out: Path, phase, slots: int,
               inputs: torch.Generator) -> Graph:
    """Load ``name`` ("draft" or "target"), round its weights, trace it to ONNX (its verification
    inputs drawn from ``inputs``), compute the reference outputs, let its PyTorch weights go,
    write its weights' blocks into the graph and verify it. The reference is taken before the
    weights are let go, so that ONNX Runtime's view of the weights never sits beside PyTorch's
    copy."""
    limits = sources.limits
    phase(f"{name}: load")
    module, lazy = _load(name, sources, options)
    weights, lazy = _round(name, module, lazy, sources, options, phase)
    keep_float = quantize.float_weights(module)
    spec = draft_spec(module, limits) if name == "draft" else target_spec(module, limits, slots=slots)
    described = _describe(module, options.confidence_threshold)
    trace, verify = example_inputs(spec, limits, sources.target_config.vocab_size,
                                   sources.draft_config.block_size, inputs)
    if name == "target":
        with resident(module, lazy):
            verify = with_context(module, verify, held_out_texts(sources.tokenizer, 256),
                                  limits.max_prompt_chunk)
    phase(f"{name}: export")
    blocks = BlocksIntoGraph(weights, keep_float, options.backend == "onnx") if weights.blocks_of else None
    path = export_graph(module, spec, trace, limits, out, options.opset, weights=lazy,
                        rewrite=blocks if lazy is not None else None)   # never written as floats
    del trace
    phase(f"{name}: reference outputs")
    with resident(module, lazy):
        expected = None if options.dtype == "bf16" else dict(zip([t.name for t in spec.outputs],
                                                                  reference_outputs(module, verify)))
    release_weights(module)
    del module
    release_freed_memory()
    quantized = weights.count
    if blocks is not None:
        if blocks.count is None:
            phase(f"{name}: {options.formats[name]} weights into the graph")
            blocks.into_written(path)
            release_freed_memory()
        quantized = _counted(blocks.count, path, weights, sources)
    phase(f"{name}: verify")
    check_model(path)
    # the target is also checked as the ORT backend runs it (a sequence per call, lowered), with
    # these rotary tables
    rotary = None if name == "draft" else target_rotary(described, limits.max_seq_len)
    difference = None if expected is None else compare_with_reference(
        path, verify, expected, options.dtype_name,
        drafts=("tokens", "q") if name == "draft" else None, rotary=rotary)
    return Graph(described, spec, quantized, difference, weights.quality)


def describe(sources: Sources, options: Options, graphs: dict[str, Graph]) -> dict:
    """The manifest (``common/manifest.schema.json``) of the graphs built."""
    formats = options.formats
    return {
        "created_by": "dspark-trt",
        "source": sources.described,
        "target": graphs["target"].described,
        "draft": graphs["draft"].described,
        "limits": asdict(sources.limits),
        "dtype": options.dtype_name,
        "weights": {**formats, "block_size": options.weights_block if formats["target"] != quantize.FLOAT
                    else None, "quality": graphs["target"].quality},
        "opset": options.opset,
        "graphs": {name: graphs[name].spec.to_json() for name in ("target", "draft")},
        "backends": ["onnx"],
        "tools": _tool_versions(),
        "tokenizer": TOKENIZER_DIR,
    }


def add_engines(out: Path, manifest: dict, backend: str, gpus: tuple[str, ...]) -> None:
    """``backend``'s TensorRT engines of the graphs written in ``out``, for each of ``gpus``, into
    ``out`` and ``manifest``."""
    from export.trt_build import build_engines

    engines = build_engines(out, manifest, backend, list(gpus))
    manifest["backends"].append(backend)
    manifest["tools"][backend] = engines.pop("version")
    manifest[backend] = engines


def _check_gguf_weights(target: str, target_dir: Path) -> None:
    """``--weights gguf`` needs a GGUF file whose every matrix is of a type the graph keeps."""
    if target_dir.suffix != ".gguf":
        raise ValueError(f"--weights gguf: the target {target} is not a .gguf file; use --weights int4 "
                         f"or int8")
    if unsupported := unsupported_matrices(target_dir):
        more = ", ..." if len(unsupported) > 3 else ""
        raise ValueError(f"--weights gguf: {target_dir} holds {len(unsupported)} matrices of types it "
                         f"cannot keep ({', '.join(unsupported[:3])}{more}; it keeps "
                         f"{' / '.join(SUPPORTED)}); use --weights int4 or int8")


def _load(name: str, sources: Sources, options: Options) -> tuple[TargetStep | DraftStep, LazyWeights | None]:
    """The module, and where it holds placeholders, the weights that read its own from the files
    (``lazy_weights``): a GGUF target whose weights the graph keeps as the file's blocks or as
    floats (rounding them again needs them all in the module), a draft rounded to blocks (a float
    draft's graph holds its weights transposed, which the optimizer makes from the module's)."""
    dtype = DTYPES[options.dtype]
    if name == "draft":
        paths, given = (sources.draft_dir, sources.target_dir), dict(k=options.k, dtype=dtype,
                                                                     markov_top_k=options.markov_top_k)
        if options.formats["draft"] == quantize.FLOAT:
            return load_draft(*paths, **given), None
        return load_draft_lazily(*paths, **given)
    taps = sources.draft_config.target_layer_ids
    if options.formats["target"] in (quantize.GGUF, quantize.FLOAT):
        return load_target_lazily(sources.target_dir, taps=taps, dtype=dtype)
    return load_target(sources.target_dir, taps=taps, dtype=dtype), None


def _round(name: str, module: TargetStep | DraftStep, lazy: LazyWeights | None, sources: Sources,
           options: Options, phase) -> tuple[Weights, LazyWeights | None]:
    """``module``'s weights rounded as its graph will hold them: to int4 / int8 blocks (the
    module's values replaced by the rounded ones, or the ``lazy`` weights rounding them as they
    are read), or a GGUF file's own blocks (Q6_K experts, which the engine rounds again, rounded
    first), or left float; and the module's lazy weights after."""
    weight_format = options.formats[name]
    bits = quantize.BITS.get(weight_format)
    if bits:
        phase(f"{name}: quantize")
        # int8 embedding rows on ONNX engines: TensorRT-RTX's builder fails on their gather (a
        # CUDA runtime call on a machine without a GPU driver)
        rows = options.backend == "onnx"
        if lazy is not None:   # a draft: no quality to measure
            count, lazy = quantize.rounded_as_read(module, lazy, bits, options.weights_block, rows)
            quality = None
        else:
            count, quality = _quantize(module, bits, options.weights_block, rows,
                                       sources.tokenizer if name == "target" else None)
        return Weights(count, quantize.rtn_blocks(bits, options.weights_block),
                       quantize.rounded_embedding_blocks if rows else None, quality=quality), lazy
    if weight_format == quantize.GGUF:   # every linear layer, from the file
        phase(f"{name}: read GGUF blocks")
        linears, stacks = quantize.quantizable(module)
        gguf = GgufBlocks(sources.target_dir)
        if gguf.rounds:   # the module computes with what the engine will
            phase(f"{name}: round Q6_K experts")
            quantize.round_weights(module, gguf.engine_values)
        return Weights(len(linears) + 2 * len(stacks), gguf.lookup, gguf.lookup, gguf), lazy
    return Weights(), lazy


def _counted(in_graph: int, path: Path, weights: Weights, sources: Sources) -> int:
    """``in_graph``, the matrices the graph holds as ``weights``' blocks, checked against the
    module's count. A layer the tracer shares may be written twice (the draft's K/V projections),
    so the graph may hold more; fewer means a layer was traced in a form left unquantized."""
    if in_graph < weights.count and weights.gguf is not None:
        raise ValueError(f"{sources.target_dir}: {weights.count - in_graph} of the target's "
                         f"{weights.count} weight matrices (linear layers, experts) are not "
                         f"in it as {' / '.join(SUPPORTED)} tensors (its types: "
                         f"{', '.join(weights.gguf.types)}); use --weights int4 or int8")
    if in_graph < weights.count:
        raise VerificationError(f"{path.name}: {in_graph} linear layers quantized in the graph, "
                                f"fewer than the {weights.count} of the PyTorch reference")
    return in_graph


class Progress:
    """The build's progress on one line of standard error: the step (``[3/4]``), what it is
    doing, for how long, and the build's time so far, redrawn every second. No percentage or ETA:
    the steps take from a second (reading configs) to minutes (an int8 target's export), so a rate
    over them predicts nothing (a bar over the steps showed "target: export 50%" with an ETA of
    "<00:24" for 3m20s). A label ``STEP: what`` belongs to its step."""

    def __init__(self, steps: list[str], enabled: bool = True, clock=time.monotonic):
        self.steps, self.clock, self.enabled = steps, clock, enabled
        self.started = self.since = clock()
        self.label = steps[0]
        self.bar = tqdm(total=len(steps), disable=not enabled, leave=False, bar_format="{desc}")
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True, name="build progress")
        if enabled:
            self._ticker.start()

    def phase(self, label: str) -> None:
        self.label, self.since = label, self.clock()
        self._show()

    def line(self) -> str:
        now = self.clock()
        step = self.steps.index(self.label.split(": ")[0]) + 1
        return (f"[{step}/{len(self.steps)}] {self.label}, {tqdm.format_interval(now - self.since)} "
                f"({tqdm.format_interval(now - self.started)} in all)")

    def close(self) -> None:
        self._stop.set()
        if self._ticker.is_alive():
            self._ticker.join()
        self.bar.close()

    def _show(self) -> None:
        if self.enabled:
            self.bar.set_description_str(self.line())

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self._show()


def _describe(module: TargetStep | DraftStep, confidence_threshold: float) -> dict:
    """The manifest's entry for a loaded model: its config and, for the draft, the loop's facts."""
    if not isinstance(module, DraftStep):
        return asdict(module.config)
    return {**asdict(module.config), "k": module.k, "markov_top_k": module.markov_top_k,
            "confidence_threshold": confidence_threshold,
            "has_d2t": bool(module.d2t.any()), "target_vocab_size": module.target_vocab_size,
            "precision": {part: DTYPE_NAMES[t] for part, t in module.precision().items()}}


def _quantize(module: TargetStep | DraftStep, bits: int, block: int, embeddings: bool,
              tokenizer) -> tuple[int, dict | None]:
    """Quantize ``module``'s linear layers (and with ``embeddings`` its embeddings' rows:
    ``quantize.quantize_linears``); given the target's ``tokenizer``, also measure what that costs,
    teacher-forced on held-out text before and after (None where that text is not installed)."""
    texts = None if tokenizer is None else held_out_texts(
        tokenizer, min(QUALITY_MAX_TOKENS, module.config.max_position_embeddings))
    reference = teacher_forced(module, texts) if texts else None
    count = quantize.quantize_linears(module, bits, block, embeddings=embeddings)
    if reference is None:
        return count, None
    return count, quality_cost(reference, teacher_forced(module, texts))


def release_weights(module: torch.nn.Module) -> None:
    """Empty ``module``'s tensors in place. Deleting the module is not enough: the exporter keeps
    references to them (onnxscript's rewrite rules hold the last graph they matched, whose
    initializers wrap the module's own parameters), which would keep this model's weights in memory
    beside the next one's."""
    for tensor in module.state_dict(keep_vars=True).values():
        tensor.data = torch.empty(0, dtype=tensor.dtype)


def release_freed_memory() -> None:
    """Collect garbage and give freed heap pages back to the system. A model's weights are
    thousands of tensors of a few MB, which glibc serves from its heap rather than from their own
    mappings once a few have been freed, and it keeps those pages after they are freed: without
    ``malloc_trim`` a freed model would still count in the process's memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: nothing to trim
        pass


def _with_defaults(limits: BuildLimits, positions: int) -> BuildLimits:
    """``limits`` with a ``None`` capacity or prompt chunk made the default for a target of
    ``positions`` (``build_checks``), checked against what the target supports."""
    seq_len = limits.max_seq_len or min(build_checks.DEFAULT_MAX_SEQ_LEN, positions)
    if seq_len > positions:
        raise ValueError(f"--max-seq-len {seq_len}: the target supports at most {positions} positions")
    chunk = limits.max_prompt_chunk or min(build_checks.DEFAULT_MAX_PROMPT_CHUNK, seq_len)
    if chunk > seq_len:
        raise ValueError(f"--max-prompt-chunk {chunk}: larger than --max-seq-len {seq_len}")
    return replace(limits, max_seq_len=seq_len, max_prompt_chunk=chunk)


def _source(given: str, directory: Path) -> dict:
    revision = directory.name if "snapshots" in directory.parts else None
    return {"id": str(given), "path": str(directory.resolve()), "revision": revision,
            "files": manifest_file.file_hashes(directory)}


def _save_tokenizer(target_dir: Path, destination: Path):
    """Copy the target's tokenizer (and chat template) so the engine directory stands alone;
    returns it."""
    from transformers import AutoTokenizer

    if target_dir.suffix == ".gguf":
        _check_gguf_tokenizer(target_dir)
    try:
        location, options = hf_location(target_dir)
        tokenizer = AutoTokenizer.from_pretrained(location, **options)
    except (OSError, ValueError, KeyError) as err:   # KeyError: a GGUF tokenizer transformers cannot read
        raise CheckpointError(f"{target_dir}: no usable tokenizer ({type(err).__name__}: {err}); the engine "
                              f"directory needs the target's tokenizer files") from None
    tokenizer.save_pretrained(destination)
    return tokenizer


def _check_gguf_tokenizer(path: Path) -> None:
    """Refuse a GGUF file whose tokenizer ``transformers`` cannot rebuild: a BPE vocabulary
    (``gpt2``) with neither its merges nor the scores it derives them from, on which its GGUF
    reader fails (``KeyError: 'scores'``); llama.cpp refuses one without merges too."""
    fields = gguf_reader(path).fields
    model = fields.get("tokenizer.ggml.model")
    if model is None:
        raise CheckpointError(f"{path}: no tokenizer.ggml.model field (the file carries no tokenizer); the "
                              f"engine directory needs the target's tokenizer")
    kind = bytes(model.parts[model.data[0]]).decode()
    if kind == "gpt2" and not {"tokenizer.ggml.merges", "tokenizer.ggml.scores"} & fields.keys():
        raise CheckpointError(f"{path}: its BPE tokenizer (tokenizer.ggml.model gpt2) has no "
                              f"tokenizer.ggml.merges (nor tokenizer.ggml.scores to derive them from); "
                              f"expected the merges beside the token list")


def _save_generation_config(target_dir: Path, out: Path) -> None:
    """The target's ``generation_config.json`` beside the graphs, if it has one: its sampling
    fields are a server's defaults (``runtime/decoding/generator.py``, as vLLM's ``--generation-config
    auto``)."""
    import shutil

    source = Path(target_dir) / "generation_config.json"
    if source.is_file():
        shutil.copyfile(source, out / "generation_config.json")


def _tool_versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "onnx": onnx.__version__,
            "onnxscript": onnxscript.__version__, "onnxruntime": onnxruntime.__version__}
