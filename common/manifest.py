"""``manifest.json``: the contract between an engine directory and whatever runs it.

It records everything the runtime needs (configs, graph I/O, limits, dtype, tool versions), so
the original checkpoints are never read again, and where everything came from (ids, file hashes).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
from pathlib import Path

SCHEMA_VERSION = 3   # 2: the target graph takes logit_rows; the draft records its precision; 3: the
# draft's noise is over the target's ids (a position's noise is the target's and the draft's)
FILENAME = "manifest.json"
SCHEMA = Path(__file__).with_name("manifest.schema.json")  # of SCHEMA_VERSION; shipped as package data
HASHED_SUFFIXES = (".json", ".safetensors", ".gguf", ".model", ".jinja", ".txt")


class ManifestError(ValueError):
    """An engine directory cannot be used; the message says what to do."""


def is_cache(name: str) -> bool:
    """Whether a graph tensor is a KV cache: ``{k,v}_cache_{layer}`` in, ``{k,v}_cache_out_{layer}``
    out."""
    return "_cache_" in name


def cache_output(name: str) -> str:
    """The output a cache input comes back as, updated; runtimes bind both to the same memory."""
    return name.replace("_cache_", "_cache_out_")


def call_rows(max_prompt_chunk: int, k: int) -> int:
    """The most rows one target call writes: a prompt chunk, a verify block (``k + 1``), or the
    two rows ONNX Runtime makes of a one-row call (``runtime/backends/ort.py``). A sliding layer's
    ring holds its window plus these, less one (``plugins/block_attention/reference.py``)."""
    return max(max_prompt_chunk, k + 1, 2)


def confidence_threshold(manifest: dict) -> float:
    """The engine's default confidence threshold; engines built before it existed verify all k."""
    return manifest["draft"].get("confidence_threshold", 0.0)


def _cut(threshold: float) -> str:
    """What the confidence threshold does to a step's drafts, in words (0: nothing)."""
    if threshold == 0:
        return "no confidence cut: every draft is verified"
    return f"cut at confidence < {threshold}"


def weight_formats(manifest: dict) -> dict[str, str]:
    """Each graph's weight format: ``float`` (the build dtype), ``int4``, ``int8`` or ``gguf``; engines built
    before quantization existed are float."""
    weights = manifest.get("weights", {})
    return {name: weights.get(name, "float") for name in ("target", "draft")}


def describe_weights(manifest: dict) -> str:
    """The weight formats in one line, with the quantized target's measured quality cost."""
    weights = manifest.get("weights", {})
    text = ", ".join(f"{name} {form}" for name, form in weight_formats(manifest).items())
    if "gguf" in weight_formats(manifest).values():
        text += " (the GGUF file's own blocks)"
    elif weights.get("block_size"):
        text += f" (symmetric RTN, blocks of {weights['block_size']})"
    quality = weights.get("quality")
    if quality:
        perplexity = quality["perplexity"]
        text += (f"; quantized target vs unquantized on {quality['tokens']} held-out tokens: top-1 "
                 f"agreement {quality['top1_agreement']:.1%}, perplexity {perplexity['quantized']:.3g} "
                 f"vs {perplexity['reference']:.3g}")
    return text


def file_hashes(checkpoint: Path) -> dict[str, str]:
    """``sha256`` of each config, weight and tokenizer file of a checkpoint directory (or of the
    one file, for a GGUF target)."""
    hashes = {}
    files = [checkpoint] if checkpoint.is_file() else sorted(checkpoint.iterdir())
    for path in files:
        if path.is_file() and path.suffix in HASHED_SUFFIXES:
            digest = hashlib.sha256()
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    digest.update(block)
            hashes[path.name] = "sha256:" + digest.hexdigest()
    return hashes


def write(directory: Path, manifest: dict) -> Path:
    """Write ``manifest.json``, checked against the schema first: what build writes is what every
    reader takes."""
    path = directory / FILENAME
    text = json.dumps({"schema_version": SCHEMA_VERSION, **manifest}, indent=2) + "\n"
    problem = violation(json.loads(text))
    if problem:
        raise ManifestError(f"{path}: {problem}; not written (a dspark-trt bug: the manifest "
                            f"disagrees with {SCHEMA.name})")
    path.write_text(text)
    return path


def read(directory: Path) -> dict:
    """The manifest of an engine directory, checked against the schema of its version."""
    path = Path(directory) / FILENAME
    if not path.is_file():
        raise ManifestError(_not_an_engine(Path(directory)))
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ManifestError(f"{path}: not valid JSON ({err}); rebuild the engine directory") from None
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise ManifestError(f"{path}: schema_version {version!r} is newer than this dspark-trt "
                            f"understands ({SCHEMA_VERSION}); upgrade dspark-trt or rebuild")
    problem = violation(manifest)
    if problem:
        raise ManifestError(f"{path}: {problem}; rebuild the engine directory")
    return manifest


def _not_an_engine(directory: Path) -> str:
    """What to say of a directory that has no manifest: it is not there, it is a checkpoint (which
    ``build`` reads, and will not write into), or it has not been built into."""
    if not directory.exists():
        return f"{directory}: no such engine directory"
    if not directory.is_dir():
        return f"{directory}: a file, not an engine directory"
    marker = next((name for name in ("config.json", "model.safetensors.index.json")
                   if (directory / name).is_file()), None)
    if marker:
        return (f"{directory}: a model checkpoint ({marker}), not an engine directory; build an "
                f"engine from checkpoints with `python -m export build --target TARGET --draft DRAFT "
                f"--out engines/NAME` and pass that folder")
    return (f"{directory / FILENAME}: missing; build an engine directory with "
            f"`python -m export build --target ... --draft ... --out {directory}`")


def violation(manifest) -> str | None:
    """The first way ``manifest`` breaks ``manifest.schema.json``, as '$.json.path: what was
    expected', or None."""
    from jsonschema.exceptions import best_match

    error = best_match(_validator().iter_errors(manifest))
    if error is None:
        return None
    if error.validator == "const":
        message = f"expected {error.validator_value!r}, got {error.instance!r}"
    else:
        message = error.message
    if len(message) > 200:  # the message quotes the value, which may be a whole section
        message = message[:200] + "..."
    return f"{error.json_path}: {message}"


@functools.cache
def _validator():
    from jsonschema import Draft202012Validator

    return Draft202012Validator(json.loads(SCHEMA.read_text()))


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _shape(tensor: dict) -> str:
    return ", ".join(str(s) for s in tensor["shape"])


# transformers' layer types, as ``inspect`` names them
LAYER_KINDS = {"linear_attention": "gated-DeltaNet", "sliding_attention": "sliding",
               "full_attention": "full attention"}


def _layer_kinds(target: dict) -> str:
    """The layer kinds of a target whose config part lists ``layer_types``: `` (3 gated-DeltaNet,
    1 full attention)``, `` (5 sliding (window 1024), 1 full attention)``; else nothing."""
    part = next((p for p in target.values() if isinstance(p, dict) and "layer_types" in p), None)
    if part is None:
        return ""
    types = part["layer_types"]
    window = f" (window {part['sliding_window']})" if "sliding_window" in part else ""
    kinds = [f"{types.count(kind)} {name}{window if kind == 'sliding_attention' else ''}"
             for kind, name in LAYER_KINDS.items() if kind in types]
    shared = part.get("kv_shared_layers")
    return f" ({', '.join(kinds)}{f', the last {shared} reusing earlier K/V' if shared else ''})"


def describe(manifest: dict) -> str:
    """The manifest in human terms, for ``python -m export inspect``."""
    t, d, limits = manifest["target"], manifest["draft"], manifest["limits"]
    td = t["decoder"]
    lines = [
        f"target   {manifest['source']['target']['id']}",
        f"         {t['architecture']}, {td['num_layers']} layers{_layer_kinds(t)}, "
        f"hidden {td['hidden_size']}, "
        f"{td['num_heads']} heads / {td['num_kv_heads']} KV heads, vocab {t['vocab_size']}",
        f"draft    {manifest['source']['draft']['id']} ({d['source_format']} format)",
        f"         {d['decoder']['num_layers']} layers, block {d['block_size']} ({d['layout']}), "
        f"k = {d['k']} drafts per step ({_cut(confidence_threshold(manifest))}), "
        f"taps {d['target_layer_ids']} (DeepSpec convention), "
        f"Markov rank {d['markov_rank']}, draft vocab {d['draft_vocab_size']}"
        + (" with d2t" if d["has_d2t"] else ""),
        f"limits   batch <= {limits['max_batch']}, KV capacity {limits['max_seq_len']} per "
        f"sequence, prompt chunk <= {limits['max_prompt_chunk']}",
        f"dtype    {manifest['dtype']}, ONNX opset {manifest['opset']}; draft parts: "
        + ", ".join(f"{part} {dtype}" for part, dtype in d["precision"].items()),
        f"weights  {describe_weights(manifest)}",
    ]
    for name, graph in manifest["graphs"].items():
        lines.append(f"graph    {name}: {graph['file']}")
        for kind in ("inputs", "outputs"):
            tensors = graph[kind]
            for tensor in (t for t in tensors if not is_cache(t["name"])):
                lines.append(f"           {kind[:-1]:6} {tensor['name']:12} {tensor['dtype']:8} "
                             f"[{_shape(tensor)}]")
            caches = [t for t in tensors if is_cache(t["name"])]
            if caches and kind == "inputs":   # one line per cache shape (K and V; a hybrid's banks)
                for shape in {(t["dtype"], str(t["shape"])): None for t in caches}:
                    same = [t for t in caches if (t["dtype"], str(t["shape"])) == shape]
                    size = sum(math.prod(s for s in t["shape"] if isinstance(s, int)) * _ITEMSIZE[t["dtype"]]
                               for t in same)
                    lines.append(f"           {kind[:-1]:6} {same[0]['name']} .. {same[-1]['name']}: "
                                 f"{len(same)} caches {same[0]['dtype']} [{_shape(same[0])}], "
                                 f"{size / 2**20:.1f} MiB per sequence")
            elif caches:
                lines.append(f"           {kind[:-1]:6} {caches[0]['name']} .. {caches[-1]['name']}: "
                             f"the input caches, updated")
    tools = ", ".join(f"{k} {v}" for k, v in manifest["tools"].items())
    lines.append(f"backends {', '.join(manifest['backends'])} (built with {tools})")
    return "\n".join(lines)
