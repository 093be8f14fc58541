"""The attention lowered to ONNX Runtime's own kernels when the ORT backend loads a graph at
batch 1 (the target's causal attention to GroupQueryAttention, the draft's block to an Attention
over the rows it sees), and the draft's Markov sampler to one compiled op: every layer lowered,
the same results as the portable graph step after step, and the build verifying that form."""
import numpy as np
import onnx_ir as ir
import pytest
import torch

from common.manifest import is_cache
from plugins.block_attention import ort_contrib
from plugins.cpu import build
from plugins.d2t_gather import ort_cpu as markov
from runtime.backends.ort import OrtBackend

from conftest import ENGINE_CASES, LIMITS, MARKOV_TOP_K

pytestmark = pytest.mark.slow   # the real-model tier: builds engines or runs servers

CASES = {**ENGINE_CASES, "markov-top-k": MARKOV_TOP_K}


@pytest.fixture(scope="module", params=CASES)
def engine(request, engine_dir):
    return engine_dir(LIMITS, **CASES[request.param])


def test_each_layer_of_both_graphs_is_lowered_the_targets_with_its_rotations(engine):
    backend = OrtBackend(engine)
    graphs = backend.manifest["graphs"]
    target, draft = (ir.load(engine / graphs[name]["file"]) for name in ("target", "draft"))
    layers = backend.manifest["target"]["decoder"]["num_layers"]
    assert ort_contrib.lower(target, backend._rotary) == layers
    ops = [node.op_type for node in target.graph]
    assert ops.count("GroupQueryAttention") == layers and "BlockAttention" not in ops
    assert "RotaryEmbedding" not in ops
    assert all(node.attributes["do_rotary"].value == 1 for node in target.graph
               if node.op_type == "GroupQueryAttention")
    assert ops.count("ReduceMax") == 1   # the sequence lengths are computed once, not per layer
    draft_layers = backend.manifest["draft"]["decoder"]["num_layers"]
    assert ort_contrib.lower(draft, backend._rotary) == draft_layers
    ops = [node.op_type for node in draft.graph]
    assert ops.count("Attention") == draft_layers and "BlockAttention" not in ops
    # the caches pass through the attention: the context's CacheWrite writes the bound buffer
    assert {value.producer().op_type for value in draft.graph.outputs if is_cache(value.name)} \
        == {"CacheWrite"}
    assert backend.lowered == {"target": True, "draft": True}


def test_the_drafts_markov_sampler_is_one_node(engine):
    """Its ~60 nodes (a softmax, scatter and D2TGather per draft) become one ``MarkovSampler``
    writing the graph's ``tokens`` and ``q``; the proposals are compared with the portable
    graph's below (``compiled-kernels``)."""
    manifest = OrtBackend(engine).manifest
    draft = ir.load(engine / manifest["graphs"]["draft"]["file"])
    k, top_k = OrtBackend(engine).limits.k, manifest["draft"]["markov_top_k"]
    assert [node.op_type for node in draft.graph].count("D2TGather") == k
    (name, weight), = markov.lower(draft, "weights").items()
    ops = [node.op_type for node in draft.graph]
    assert ops.count(markov.OP) == 1 and not {"D2TGather", "Softmax", "ScatterElements", "TopK"} & set(ops)
    sampler = next(node for node in draft.graph if node.op_type == markov.OP)
    assert [value.name for value in sampler.outputs] == ["tokens", "q"]
    assert sampler.attributes["top_k"].value == top_k
    # markov_w2 as the kernel reads it: transposed [r, Vd] for the whole chain, its rows [Vd, r] for top-K
    assert sampler.inputs[6].name == name
    assert weight.shape[1 if top_k == 0 else 0] == manifest["draft"]["draft_vocab_size"]


@pytest.mark.parametrize("kernel", [False, True], ids=["onnx-runtime-kernels", "compiled-kernels"])
def test_the_lowered_graph_gives_the_portable_graphs_results_step_by_step(engine, kernel):
    """Prefill chunks, one-row and multi-row steps at batch 1 (the lowered session: ONNX
    Runtime's attention, or the compiled kernels' batched form) against the same steps through
    the portable graph: logits, taps and every cache row written so far."""
    lowered, portable = OrtBackend(engine, kernel=kernel), OrtBackend(engine, lower=False)
    assert lowered.batched == (kernel and build.library() is not None)
    for backend in (lowered, portable):
        backend.start(1)
    assert lowered.sessions["target"] is not portable.sessions["target"]
    ids = torch.randint(3, 60, (1, 40), generator=torch.Generator().manual_seed(0))
    position = 0
    for rows in (8, 5, 1, 2, 5, 1, 3, 1):
        step = (ids[:, position:position + rows], torch.tensor([position]), torch.arange(rows)[None])
        (logits, aux), (logits_p, aux_p) = lowered.target_step(*step), portable.target_step(*step)
        torch.testing.assert_close(logits, logits_p, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(aux, aux_p, rtol=1e-4, atol=1e-4)
        position += rows
    binding = lowered.pools["target"][1] if lowered.batched else lowered.bindings[0]["target"]
    caches = [v.numpy()[:, :, :position] for v in binding.get_outputs()[:4]]
    caches_p = [v.numpy()[:, :, :position] for v in portable.bindings[0]["target"].get_outputs()[:4]]
    assert all(np.abs(c).sum() > 0 for c in caches)
    for cache, cache_p in zip(caches, caches_p):
        np.testing.assert_allclose(cache, cache_p, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", [False, True], ids=["onnx-runtime-kernels", "compiled-kernels"])
def test_the_lowered_draft_gives_the_portable_drafts_proposals_step_by_step(engine, kernel):
    """Draft steps after a prefill and after verify steps of several lengths, sampled (so that
    the probabilities are finite and compared), at batch 1 lowered (ONNX Runtime's attention, or
    the compiled kernels' batched form) and portable: the same proposals and probabilities, and
    the same context rows in the caches."""
    lowered, portable = OrtBackend(engine, kernel=kernel), OrtBackend(engine, lower=False)
    assert ("draft" in lowered.pool_graphs) == (kernel and build.library() is not None)
    draft = lowered.manifest["draft"]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (1, 30), generator=generator)
    uniform = torch.rand(4, 1, draft["k"], draft["target_vocab_size"], generator=generator)
    noise = -torch.log(-torch.log(uniform))   # Gumbel
    results = []
    for backend in (lowered, portable):
        backend.start(1)
        _, aux = backend.target_step(ids, torch.tensor([0]), torch.tensor([[29]]))
        steps, seen = [], 0
        for index, rows in enumerate((20, 3, 1, 4)):   # context rows the verify steps accepted
            context = (aux[:, seen:seen + rows], torch.tensor([seen]), torch.tensor([rows]))
            steps.append(backend.draft_step(*context, ids[:, seen + rows], torch.ones(1), noise[index]))
            seen += rows
        # the caches are bound first
        pooled = "draft" in backend.pool_graphs
        binding = backend.pools["draft"][1] if pooled else backend.bindings[0]["draft"]
        bound = binding.get_outputs()[:2 * draft["decoder"]["num_layers"]]
        caches = [v.numpy()[:, :, :seen].copy() for v in bound]
        results.append((steps, caches))
    (steps, caches), (steps_p, caches_p) = results
    top_k = draft["markov_top_k"]
    for (tokens, q), (tokens_p, q_p) in zip(steps, steps_p):
        assert torch.equal(tokens, tokens_p)
        torch.testing.assert_close(q, q_p, rtol=1e-4, atol=1e-5)
        if top_k:   # each draft drawn from its row's top K: K ids with mass, the draft among them
            assert ((q > 0).sum(-1) == top_k).all() and (q.gather(-1, tokens[..., None]) > 0).all()
    assert all(np.abs(c).sum() > 0 for c in caches)
    for cache, cache_p in zip(caches, caches_p):
        np.testing.assert_allclose(cache, cache_p, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("graph, lowered_op", [("target", "GroupQueryAttention"), ("draft", "Attention")])
def test_the_build_verifies_the_lowered_form(tiny, tmp_path, monkeypatch, graph, lowered_op):
    """A lowering that changed the result (here: the wrong attention scale) fails the build."""
    from common.errors import VerificationError
    from export import build

    lower = ort_contrib.lower

    def wrong(model, rotary=None):
        count = lower(model, rotary)
        for node in model.graph:
            if node.op_type == lowered_op:
                node.attributes["scale"] = ir.AttrFloat32("scale", 0.5 * node.attributes["scale"].value)
        return count

    monkeypatch.setattr(ort_contrib, "lower", wrong)
    target_dir, draft_dir = tiny(**ENGINE_CASES["qwen3-native"])
    with pytest.raises(VerificationError, match=f"{graph}.onnx: .* as ONNX Runtime runs it at batch 1"):
        build.build(str(target_dir), str(draft_dir), tmp_path / "engine", limits=LIMITS, progress=False)


def test_an_engine_whose_files_are_links_into_a_cache_runs_lowered(engine_dir, tmp_path):
    """A Hugging Face cache's snapshot holds links to blobs named by hash: ONNX Runtime refuses a
    graph loaded from memory whose weights file is a link out of its folder, so the lowered graph
    gets the file mapped instead, and generates what the engine itself does."""
    from runtime.decoding.batch import generate

    from conftest import PROMPTS

    engine = engine_dir(LIMITS, **ENGINE_CASES["qwen3-native"])
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    for index, file in enumerate(sorted(engine.rglob("*"))):
        if file.is_file():
            blob = blobs / f"{index:040x}"
            blob.write_bytes(file.read_bytes())
            link = snapshot / file.relative_to(engine)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(blob)
    linked = OrtBackend(snapshot)
    assert linked.lowered == {"target": True, "draft": True}
    expected = generate(OrtBackend(engine), PROMPTS[:1], max_new_tokens=12)
    assert generate(linked, PROMPTS[:1], max_new_tokens=12).token_ids == expected.token_ids
