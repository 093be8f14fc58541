"""``python -m export build``: the graph contract, and ONNX Runtime against the PyTorch reference
on the exact inputs the reference loop feeds its steps (prefill, verify, draft; ragged batch 3)."""
import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from common.manifest import cache_output, is_cache
from modeling.pair import load_pair
from plugins.onnx_domain import DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION
from runtime.backends.pytorch import TorchBackend
from runtime.decoding.batch import generate

from conftest import ENGINE_CASES, LIMITS, PROMPTS


@pytest.fixture(scope="module", params=ENGINE_CASES)
def engine(request, tiny, engine_dir):
    return (engine_dir(LIMITS, **ENGINE_CASES[request.param]), *tiny(**ENGINE_CASES[request.param]))


def _manifest(directory):
    return json.loads((directory / "manifest.json").read_text())


def test_custom_nodes_and_their_function_bodies(engine):
    directory, *_ = engine
    expected_ops = {"target": {"BlockAttention"}, "draft": {"BlockAttention", "CacheWrite", "D2TGather"}}
    for name, ops in expected_ops.items():
        model = onnx.load(directory / f"{name}.onnx")
        assert {(o.domain, o.version) for o in model.opset_import} >= {("", 23), (DOMAIN, 1)}
        custom = [n for n in model.graph.node if n.domain == DOMAIN]
        assert {n.op_type for n in custom} == ops
        for node in custom:
            attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attributes["plugin_namespace"] == PLUGIN_NAMESPACE.encode()
            assert attributes["plugin_version"] == PLUGIN_VERSION.encode()
            # TensorRT matches built-in op names first, ignoring the domain
            assert not onnx.defs.has(node.op_type, "")
        functions = {(f.domain, f.name): f for f in model.functions}
        assert set(functions) == {(DOMAIN, op) for op in ops}
        for function in functions.values():  # bodies are standard ops only
            assert function.node and all(n.domain in ("", "ai.onnx") for n in function.node)
    draft = onnx.load(directory / "draft.onnx")
    k = _manifest(directory)["draft"]["k"]
    d2t_nodes = [n for n in draft.graph.node if n.op_type == "D2TGather"]
    assert len(d2t_nodes) == k  # the Markov sampler is unrolled k times inside the graph
    blocks = [n for n in draft.graph.node if n.op_type == "BlockAttention"]
    assert all(onnx.helper.get_attribute_value(a) == 0 for n in blocks for a in n.attribute
               if a.name == "causal")


def test_draft_context_rows_are_written_by_the_plugin_not_a_scatter(engine):
    """Every cache goes graph input -> ``CacheWrite`` (context rows) -> ``BlockAttention`` (block
    rows) -> graph output: a chain TensorRT can keep in one buffer. A standard-op scatter on the way
    would make TensorRT materialise a whole new cache every step."""
    directory, *_ = engine
    graph = onnx.load(directory / "draft.onnx").graph
    caches = {v.name for v in graph.input if is_cache(v.name)}
    producers = {output: node for node in graph.node for output in node.output}
    chained = set()
    for block in (n for n in graph.node if n.op_type == "BlockAttention"):
        for position, output in ((3, 1), (4, 2)):                  # k_cache -> k_cache_out, v likewise
            write = producers[block.input[position]]
            assert (write.domain, write.op_type) == (DOMAIN, "CacheWrite")
            assert write.input[0] in caches and write.input[2] == "ctx_start"
            assert block.output[output] == cache_output(write.input[0])
            chained.add(write.input[0])
    assert chained == caches and len(caches) == 2 * _manifest(directory)["draft"]["decoder"]["num_layers"]
    assert not [n.name for n in graph.node if n.op_type == "ScatterElements" and n.input[0] in caches]


def test_graph_io_matches_the_manifest(engine):
    directory, *_ = engine
    manifest = _manifest(directory)
    type_names = {1: "float32", 7: "int64", 10: "float16", 16: "bfloat16"}
    for name, graph in manifest["graphs"].items():
        model = onnx.load(directory / graph["file"])
        for kind, values in (("inputs", model.graph.input), ("outputs", model.graph.output)):
            actual = [(v.name, type_names[v.type.tensor_type.elem_type],
                       [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim])
                      for v in values]
            declared = [(t["name"], t["dtype"], t["shape"]) for t in graph[kind]]
            assert actual == declared


def test_a_tied_target_holds_its_embedding_once(engine):
    """The Llama pair ties lm_head to the embeddings, the Qwen3 pair does not: a [V, H] weight
    (or its transpose) is stored once, respectively twice, in target.onnx.data."""
    directory, *_ = engine
    target = _manifest(directory)["target"]
    vocab, hidden = target["vocab_size"], target["decoder"]["hidden_size"]
    model = onnx.load(directory / "target.onnx", load_external_data=False)
    embeddings = [i.name for i in model.graph.initializer if sorted(i.dims) == sorted([vocab, hidden])]
    assert len(embeddings) == (1 if target["tie_word_embeddings"] else 2), embeddings


def test_manifest_makes_the_directory_self_contained(engine):
    directory, target_dir, draft_dir = engine
    manifest = _manifest(directory)
    assert manifest["schema_version"] == 3 and manifest["opset"] == 23
    assert manifest["limits"] == dataclasses.asdict(LIMITS)
    assert set(manifest["source"]["target"]["files"]) >= {"config.json", "model.safetensors"}
    assert all(h.startswith("sha256:") for h in manifest["source"]["draft"]["files"].values())
    assert (directory / manifest["tokenizer"] / "tokenizer.json").is_file()
    assert manifest["draft"]["target_layer_ids"] == [0, 2]
    assert manifest["draft"]["has_d2t"] == (manifest["draft"]["draft_vocab_size"] < 85)


class Recorder(TorchBackend):
    """The reference backend, remembering every step's inputs (caches included) and outputs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"target": [], "draft": []}

    @staticmethod
    def _caches(tensors):
        """``k_cache_0, v_cache_0, k_cache_1, ...`` feeds, copied before the step writes."""
        return {f"{'kv'[i % 2]}_cache_{i // 2}": t.clone() for i, t in enumerate(tensors)}

    def target_step(self, input_ids, start, logit_rows, state_slot=None, state_rows=None, slots=None):
        feeds = {"input_ids": input_ids, "start": start, "logit_rows": logit_rows,
                 **self._caches(self.target_cache)}
        # these dense targets keep no state
        out = super().target_step(input_ids, start, logit_rows, slots=slots)
        self.calls["target"].append((feeds, [*out, *self.target_cache]))
        return out

    def draft_step(self, ctx_aux, ctx_start, ctx_count, anchor, temperature, noise, slots=None):
        feeds = dict(ctx_aux=ctx_aux, ctx_start=ctx_start, ctx_count=ctx_count, anchor=anchor,
                     temperature=temperature, noise=noise, **self._caches(self.draft_cache))
        out = super().draft_step(ctx_aux, ctx_start, ctx_count, anchor, temperature, noise, slots=slots)
        self.calls["draft"].append((feeds, [*out, *self.draft_cache]))
        return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_onnx_runtime_matches_the_reference_on_every_loop_step(engine, temperature):
    directory, target_dir, draft_dir = engine
    target, draft = load_pair(target_dir, draft_dir)
    recorder = Recorder(target, draft, capacity=LIMITS.max_seq_len, max_prompt_chunk=LIMITS.max_prompt_chunk)
    generate(recorder, PROMPTS, max_new_tokens=24, temperature=temperature, seed=3)
    for name, calls in recorder.calls.items():
        session = ort.InferenceSession(str(directory / f"{name}.onnx"))
        outputs = [o.name for o in session.get_outputs()]
        assert len(calls) > 3
        for feeds, expected in calls:
            got = session.run(outputs, {k: v.numpy() for k, v in feeds.items()})
            for output, actual, reference in zip(outputs, got, expected):
                reference = reference.numpy()
                if reference.dtype == np.int64:   # draft tokens: identical
                    assert np.array_equal(actual, reference), (name, output)
                else:  # logits and q to 1e-4; residual-stream aux and caches relative to their size
                    scale = 1.0 if output in ("logits", "q") else max(1.0, float(np.abs(reference).max()))
                    assert np.abs(actual - reference).max() <= 1e-4 * scale, (name, output)


def test_drafts_may_differ_only_at_a_near_tie():
    """fp16 rounding may flip an argmax between two nearly equal probabilities (random-weight
    drafts are full of such ties); the rows after the flip are conditioned on another token and
    are not compared, while a flip between clearly ranked tokens is an error."""
    from export.onnx_check import VerificationError, _comparable_drafts

    reference = np.array([[3, 1, 4], [1, 5, 9]])
    probabilities = np.full((2, 3, 10), 0.01)
    probabilities[1, 1, [5, 6]] = [0.300, 0.299]        # sequence 1, row 1: tokens 5 and 6 nearly tie
    assert _comparable_drafts(Path("draft.onnx"), reference.copy(), reference, probabilities, 2e-2) == 3
    flipped = np.array([[3, 1, 4], [1, 6, 2]])           # the tie flipped, then the chain went its own way
    assert _comparable_drafts(Path("draft.onnx"), flipped, reference, probabilities, 2e-2) == 1
    with pytest.raises(VerificationError, match=r"draft 1 of sequence 1 is token 6, .* not a near tie"):
        _comparable_drafts(Path("draft.onnx"), flipped, reference, probabilities, 1e-3)
    probabilities[0, 0, [3, 7]] = [0.5, 0.1]
    with pytest.raises(VerificationError, match="draft 0 of sequence 0 is token 7"):
        _comparable_drafts(Path("draft.onnx"), np.array([[7, 1, 4], [1, 5, 9]]), reference,
                           probabilities, 2e-2)
