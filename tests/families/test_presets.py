"""``make-tiny --preset``: random pairs in the exact shapes of released models. The real presets are
benchmarks (scripts/scale_bench.py); here their shapes are checked on the meta device and a
scaled-down preset is written and loaded."""
import json
import os
import stat
from pathlib import Path

import pytest
import torch

import export.__main__ as cli
from modeling.fixtures import presets
from modeling.pair import load_pair


@pytest.mark.parametrize("name, non_embedding", [
    ("qwen3-0.6b", 0.44e9), ("qwen3-1.7b", 1.4e9), ("qwen3-4b", 3.6e9), ("qwen3-8b", 6.95e9)])
def test_preset_shapes_have_the_released_parameter_counts(name, non_embedding):
    """The model cards' non-embedding parameter counts, to their printed precision."""
    from transformers import AutoConfig, AutoModelForCausalLM

    p = presets.PRESETS[name]
    config = AutoConfig.for_model("qwen3", **{k: getattr(p, k) for k in p.__dataclass_fields__})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embeddings = p.vocab_size * p.hidden_size * (1 if p.tie_word_embeddings else 2)
    count = sum(t.numel() for t in model.parameters()) - embeddings
    assert abs(count - non_embedding) < 0.01 * non_embedding, count


def test_release_taps():
    assert presets.release_taps(36) == [1, 9, 17, 25, 33]       # deepseek-ai/dspark_qwen3_4b_block7
    assert presets.release_taps(28) == [1, 7, 13, 19, 25]


@pytest.fixture
def small_preset(monkeypatch):
    """A preset with the real vocabulary and draft shape but a narrow, short target, in shards."""
    monkeypatch.setitem(presets.PRESETS, "qwen3-small", presets.Preset(64, 8, 4, 128, True,
                                                                        num_key_value_heads=2, head_dim=16))
    monkeypatch.setattr(presets, "SHARD_SIZE", "8MB")
    return "qwen3-small"


def test_preset_pair_is_written_in_release_layouts_and_loads(small_preset, tmp_path):
    cli.main(["make-tiny", str(tmp_path / "pair"), "--preset", small_preset])
    target_dir, draft_dir = tmp_path / "pair" / "target", tmp_path / "pair" / "draft"
    index = json.loads((target_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" not in index["weight_map"]
    umask = os.umask(0)
    os.umask(umask)
    for file in [*target_dir.glob("*.safetensors"), *draft_dir.glob("*.safetensors")]:
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~umask, file

    draft_config = json.loads((draft_dir / "config.json").read_text())
    assert draft_config["num_hidden_layers"] == 5 and draft_config["block_size"] == 7
    assert draft_config["markov_rank"] == 256 and draft_config["mask_token_id"] == 151669
    target, draft = load_pair(target_dir, draft_dir)
    assert draft.k == 7 and draft.config.target_layer_ids == (1, 2, 3, 4, 5)
    assert draft.embed_tokens.weight.shape == (151936, 64)
    # the draft's own embeddings, not the target's shared ones
    assert not torch.equal(draft.embed_tokens.weight, target.embed_tokens.weight)
    assert target.lm_head.weight.data_ptr() == target.embed_tokens.weight.data_ptr()   # tied, held once


def test_a_hybrid_preset_slice_is_the_multimodal_layout_and_loads(monkeypatch, tmp_path):
    """A Qwen3.6-shaped preset (narrowed here), cut to its first 4 layers: three linear, one full,
    text weights under model.language_model. beside vision and MTP tensors that loading skips."""
    small = presets.Preset(64, 8, 4, 128, False, num_key_value_heads=2, head_dim=16,
                           linear=dict(presets.QWEN3_6_LINEAR, linear_key_head_dim=8,
                                       linear_value_head_dim=8, linear_num_key_heads=2,
                                       linear_num_value_heads=4))
    monkeypatch.setitem(presets.PRESETS, "qwen3.6-small", small)
    monkeypatch.setattr(presets, "SHARD_SIZE", "1MB")
    cli.main(["make-tiny", str(tmp_path / "pair"), "--preset", "qwen3.6-small", "--layers", "4"])
    target_dir, draft_dir = tmp_path / "pair" / "target", tmp_path / "pair" / "draft"
    config = json.loads((target_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["text_config"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    names = json.loads((target_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("mtp.") for n in names)
    target, draft = load_pair(target_dir, draft_dir)
    assert target.config.linear.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert draft.config.target_layer_ids == (-1, 0, 1, 2)
    with pytest.raises(SystemExit, match="--layers 65: expected 1 .. 64"):
        cli.main(["make-tiny", str(tmp_path / "p2"), "--preset", "qwen3.6-27b", "--layers", "65"])


def test_preset_refuses_tiny_shape_flags(tmp_path):
    with pytest.raises(SystemExit, match="--preset qwen3-4b: a preset fixes every shape; leave out --arch"):
        cli.main(["make-tiny", str(tmp_path / "p"), "--preset", "qwen3-4b", "--arch", "llama"])
    assert not Path(tmp_path / "p").exists()


@pytest.mark.parametrize("name, family", [("qwen3.6-35b-a3b", "Qwen3_5MoeForConditionalGeneration"),
                                          ("qwen3-30b-a3b", "Qwen3MoeForCausalLM")])
def test_moe_preset_slices_store_experts_one_by_one_and_load(monkeypatch, tmp_path, name, family):
    """The MoE presets (narrowed here to a few small experts), cut to 2 layers: the experts stored
    one by one as the releases store them, fused on loading."""
    from dataclasses import replace

    preset = presets.PRESETS[name]
    moe = dict(preset.moe, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    linear = preset.linear and dict(preset.linear, linear_key_head_dim=8, linear_value_head_dim=8,
                                    linear_num_key_heads=2, linear_num_value_heads=4)
    small = replace(preset, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=96, vocab_size=151936, linear=linear, moe=moe)
    monkeypatch.setitem(presets.PRESETS, name, small)
    cli.main(["make-tiny", str(tmp_path / "pair"), "--preset", name, "--layers", "2"])
    target_dir, draft_dir = tmp_path / "pair" / "target", tmp_path / "pair" / "draft"
    assert json.loads((target_dir / "config.json").read_text())["architectures"] == [family]
    from safetensors import safe_open

    with safe_open(next(target_dir.glob("*.safetensors")), "pt") as f:
        names = list(f.keys())
    assert any(n.endswith("mlp.experts.3.down_proj.weight") for n in names)
    target, _ = load_pair(target_dir, draft_dir)
    assert target.config.moe.num_experts == 4 and target.config.moe.sparse_layers == (True, True)
    assert target.layers[0].mlp.experts.gate_up_proj.shape == (4, 16, 64)


def test_the_gemma4_12b_preset_has_the_released_shape():
    """The release's 48 layers, 40 of them sliding, and a text model of the model card's 12B
    (11.9B with its tied 262k-row embedding; the vision and audio embedders are the rest)."""
    import transformers

    p = presets.PRESETS["gemma4-12b"]
    text = transformers.Gemma4UnifiedTextConfig(**p.shape(), **p.gemma4)
    with torch.device("meta"):
        model = transformers.Gemma4UnifiedForCausalLM(text)
    count = sum(t.numel() for t in model.parameters())
    assert 11.5e9 < count < 12.5e9, count
    assert text.layer_types.count("sliding_attention") == 40


def test_a_gemma4_preset_slice_is_the_unified_layout_with_deepspecs_draft(monkeypatch, tmp_path):
    """The 12B preset (narrowed here), cut to 7 layers: the unified ForConditionalGeneration layout
    with its vision and audio embedders, ending on a full layer; the draft DeepSpec's config with 5
    layers of the full layers' heads and block 7."""
    from dataclasses import replace

    small = replace(presets.PRESETS["gemma4-12b"], hidden_size=64, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=1000,
                    gemma4=dict(presets.GEMMA4_12B, global_head_dim=32))
    monkeypatch.setitem(presets.PRESETS, "gemma4-12b", small)
    cli.main(["make-tiny", str(tmp_path / "pair"), "--preset", "gemma4-12b", "--layers", "7"])
    target_dir, draft_dir = tmp_path / "pair" / "target", tmp_path / "pair" / "draft"
    config = json.loads((target_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma4UnifiedForConditionalGeneration"]
    assert config["text_config"]["layer_types"][-2:] == ["full_attention"] * 2
    draft_config = json.loads((draft_dir / "config.json").read_text())
    assert draft_config["architectures"] == ["Gemma4DSparkModel"] and draft_config["block_size"] == 7
    target, draft = load_pair(target_dir, draft_dir)
    assert target.config.gemma4.sliding_window == 1024 and draft.k == 7
    assert draft.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)
