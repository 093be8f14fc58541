"""Gemma 4 targets (``Gemma4ForCausalLM``, ``Gemma4ForConditionalGeneration`` and the 12B's unified
layout) with every feature on: sliding windows of 4 rows, crossed by the prompts and by every
step; full layers with their own head size and V = K; per-layer inputs; KV-shared layers; soft-
capped logits. The module against ``transformers``' own class; greedy speculative == target-only
== ``transformers`` ``generate`` at batch 1 and ragged batch 3, prompts longer than a prefill chunk
and than the window, with oracle drafts so that every acceptance count rolls the rings back; the
engines (ONNX Runtime fp32 and fp16, TensorRT-RTX fp16 built on the CPU); bad configs. The draft
against DeepSpec's own code: ``test_golden.py``."""
import importlib.util
import json
import shutil

import pytest
import torch

from common.manifest import describe
from export.onnx_export import BuildLimits
from modeling.checkpoint import CheckpointError
from modeling.pair import load_pair
from modeling.target import every_row
from runtime.backends.ort import OrtBackend
from runtime.decoding.batch import generate

from conftest import PROMPTS
from oracles import CHUNK, MAX_NEW, OrtOracle, check_engine_invariant, check_torch_invariant

pytestmark = pytest.mark.slow   # the real-model tier: builds engines or runs servers

ARCH = "gemma4-multimodal"
LIMITS = BuildLimits(max_batch=3, max_seq_len=96, max_prompt_chunk=CHUNK)
CLASSES = {"gemma4": "Gemma4ForCausalLM", "gemma4-multimodal": "Gemma4ForConditionalGeneration",
           "gemma4_unified-multimodal": "Gemma4UnifiedForConditionalGeneration",
           "gemma4_moe": "Gemma4ForCausalLM"}


@pytest.mark.parametrize("arch", CLASSES)
def test_the_target_step_gives_transformers_logits(tiny, arch):
    """Every row's logits, in one call over caches that never wrap and in calls of 3 rows over
    rings of the window plus 2 rows, which 21 positions wrap three times."""
    import transformers

    target_dir, draft_dir = tiny(arch=arch)
    target, _ = load_pair(target_dir, draft_dir)
    reference = getattr(transformers, CLASSES[arch]).from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = torch.randint(5, target.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(0))
    expected = reference(input_ids=ids).logits
    whole = target(ids, torch.tensor([0]), every_row(ids), *target.empty_cache(1, 64))[0]
    caches, parts = target.empty_cache(1, 64, max_rows=3), []
    assert {c.shape[2] for c in caches} == {target.config.gemma4.sliding_window + 2, 64}
    for begin in range(0, ids.shape[1], 3):
        chunk = ids[:, begin:begin + 3]
        logits, _, *caches = target(chunk, torch.tensor([begin]), every_row(chunk), *caches)
        parts.append(logits)
    for ours in (whole, torch.cat(parts, dim=1)):
        assert (ours - expected).abs().max() < 1e-4 * expected.abs().max()


def test_greedy_speculative_equals_target_only_and_transformers(tiny):
    oracle = check_torch_invariant(*tiny(arch=ARCH))
    rings = {c.shape[2] for c in oracle.target_cache}
    assert rings == {oracle.target.config.gemma4.sliding_window + CHUNK - 1, 96}


@pytest.mark.parametrize("arch", [ARCH, "gemma4_moe"])
def test_onnx_runtime_engine_equals_transformers(tiny, engine_dir, arch):
    """The sliding layers' attention as the ring's ONNX function, the full layers' lowered for
    ONNX Runtime (their own rotations kept), one sequence per call: transformers' output,
    speculative with every acceptance count and target-only, at batch 1 and 3. With MoE blocks
    (26B-A4B's form), each layer's routed experts are one ``MoeExperts`` node with the tanh GELU."""
    target_dir, _ = tiny(arch=arch)
    engine = engine_dir(LIMITS, arch=arch)
    manifest = json.loads((engine / "manifest.json").read_text())
    layout = manifest["target"]["gemma4"]
    assert manifest["draft"]["architecture"] == "Gemma4DSparkModel" and manifest["draft"]["gemma4"]
    caches = {t["name"]: t["shape"] for t in manifest["graphs"]["target"]["inputs"] if "_cache_" in t["name"]}
    owners = len(layout["layer_types"]) - layout["kv_shared_layers"]
    assert len(caches) == 2 * owners
    k = manifest["draft"]["k"]
    assert caches["k_cache_0"][2] == layout["sliding_window"] + max(CHUNK, k + 1) - 1
    full = ["batch", layout["full_kv_heads"], LIMITS.max_seq_len, layout["full_head_dim"]]
    assert caches["k_cache_1"] == full
    kinds = "6 layers (3 sliding (window 4), 3 full attention, the last 2 reusing earlier K/V)"
    assert kinds in describe(manifest)   # inspect
    if arch == "gemma4_moe":
        import onnx

        assert manifest["target"]["moe"]["num_experts"] == 8
        graph = onnx.load(engine / "target.onnx", load_external_data=False).graph
        experts = [n for n in graph.node if n.op_type == "MoeExperts"]
        assert len(experts) == len(layout["layer_types"])
        assert {a.i for n in experts for a in n.attribute if a.name == "activation"} == {1}
    check_engine_invariant(engine, target_dir)


def _copy(source, root):
    copy = root / source.name
    shutil.copytree(source, copy)
    return copy


def test_fp16_engines_keep_large_activations_finite(tiny, tmp_path):
    """Gemma's residual stream grows large (each sublayer's output is normed, then scaled by
    its post-norm's weights, before it is added): squared in fp16, values of a few hundred
    overflow. With the MLPs' post-norm weights 300x larger, the stream reaches ~1e3; the fp16
    engine's logits stay within 2% (the build's fp16 tolerance: its products round their inputs
    and outputs to fp16, as the graph says and a GPU does) of transformers' fp32 ones (1.3%
    measured), and its speculative output equals
    its target-only output. Its TensorRT-RTX engine, built on the CPU, has a BlockAttention plugin
    per layer, the sliding ones with their window."""
    import onnx
    import transformers
    from safetensors.torch import load_file, save_file

    from export.build import build

    target_dir, draft_dir = tiny(arch=ARCH)
    target = _copy(target_dir, tmp_path)
    weights = target / "model.safetensors"
    tensors = load_file(weights)
    for name in tensors:
        if name.endswith("post_feedforward_layernorm.weight"):
            tensors[name] *= 300
    save_file(tensors, weights)
    reference = transformers.Gemma4ForConditionalGeneration.from_pretrained(target, dtype=torch.float32)
    prompt = torch.tensor([PROMPTS[2]])
    hidden = reference(input_ids=prompt, output_hidden_states=True).hidden_states
    assert max(h.abs().max() for h in hidden) > 300     # squares past fp16's 65504
    trt = importlib.util.find_spec("tensorrt_rtx") is not None
    build(str(target), str(draft_dir), tmp_path / "engine", limits=LIMITS, dtype="fp16", progress=False,
          **(dict(backend="trt-rtx", gpus=("sm89",)) if trt else {}))
    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    types = manifest["target"]["gemma4"]["layer_types"]
    graph = onnx.load(tmp_path / "engine" / "target.onnx", load_external_data=False).graph
    windows = [next(a.i for a in n.attribute if a.name == "window") for n in graph.node
               if n.op_type == "BlockAttention"]
    assert windows == [4 if t == "sliding_attention" else 0 for t in types]
    if trt:   # a plugin per layer (a shared layer's too, over its source's caches)
        assert manifest["trt-rtx"]["plugin_layers"]["target"] == {"BlockAttention": len(types)}
    backend = OrtBackend(tmp_path / "engine")
    backend.start(1)
    logits, _ = backend.target_step(prompt[:, :CHUNK], torch.tensor([0]), torch.arange(CHUNK)[None])
    expected = reference(input_ids=prompt[:, :CHUNK]).logits
    assert torch.isfinite(logits).all()
    assert (logits.float() - expected).abs().max() < 2e-2 * expected.abs().max()
    target_only = generate(backend, PROMPTS, max_new_tokens=MAX_NEW, speculative=False).token_ids
    oracle = OrtOracle(tmp_path / "engine", PROMPTS, target_only)
    assert generate(oracle, PROMPTS, max_new_tokens=MAX_NEW).token_ids == target_only


def _edited(tiny, tmp_path, arch=ARCH, draft=False, **fields):
    target_dir, draft_dir = tiny(arch=arch)
    target, draft_copy = _copy(target_dir, tmp_path / "t"), _copy(draft_dir, tmp_path / "d")
    path = (draft_copy if draft else target) / "config.json"
    config = json.loads(path.read_text())
    section = config if draft or "text_config" not in config else config["text_config"]
    section.update(fields)
    path.write_text(json.dumps(config))
    return target, draft_copy


@pytest.mark.parametrize("fields, message", [
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=6, moe_intermediate_size=8),
     r"field 'top_k_experts' = 6: expected 1 .. num_experts \(4\)"),
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=None),
     "field 'moe_intermediate_size' = None: expected an integer >= 1"),
    (dict(use_bidirectional_attention="all"), "field 'use_bidirectional_attention' = 'all'"),
    (dict(hidden_activation="silu"), "field 'hidden_activation' = 'silu': expected 'gelu_pytorch_tanh'"),
    (dict(num_kv_shared_layers=6), "field 'num_kv_shared_layers' = 6: expected 0 .. 5"),
    (dict(sliding_window=0), "field 'sliding_window' = 0: expected an integer >= 1"),
    (dict(vocab_size_per_layer_input=10), "field 'vocab_size_per_layer_input' = 10: expected at least"),
])
def test_a_target_config_the_engine_cannot_follow_is_named(tiny, tmp_path, fields, message):
    target, draft = _edited(tiny, tmp_path, **fields)
    with pytest.raises(CheckpointError, match=rf"config.json: text_config: {message}"):
        load_pair(target, draft)


@pytest.mark.parametrize("fields, message", [
    (dict(hidden_size_per_layer_input=8), "field 'hidden_size_per_layer_input' = 8: DeepSpec's "
                                          "Gemma4DSparkModel has no per-layer inputs"),
    (dict(layer_types=["sliding_attention"]), "field 'layer_types' = \\['sliding_attention'\\]: "
                                              "expected 'full_attention' for each of the 1 draft layers"),
    (dict(model_type="qwen3"), "field 'model_type' = 'qwen3': expected 'gemma4_text' or"),
    (dict(num_global_key_value_heads=None), "field 'num_global_key_value_heads' = None: expected an integer"),
    # what the config fuzz found (tests/families/test_config_fuzz.py covers the target's config)
    (dict(num_hidden_layers=10 ** 12), "field 'num_hidden_layers' = 1000000000000: expected an integer"),
    (dict(rope_parameters={"full_attention": None}), "field 'rope_parameters.full_attention' = None"),
    (dict(rope_parameters={"full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                              "partial_rotary_factor": -1}}),
     "field 'rope_parameters.full_attention.partial_rotary_factor' = -1: expected a number in"),
    (dict(hidden_size_per_layer_input=None), "field 'hidden_size_per_layer_input' = None"),
])
def test_a_draft_config_the_engine_cannot_follow_is_named(tiny, tmp_path, fields, message):
    target, draft = _edited(tiny, tmp_path, draft=True, **fields)
    with pytest.raises(CheckpointError, match=f"config.json: {message}"):
        load_pair(target, draft)
