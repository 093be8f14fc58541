"""Random-weight pairs in the exact shapes of released models, for scale benchmarks
(``python -m export make-tiny OUT --preset qwen3-4b``).

The target is a Qwen3 checkpoint as the hub ships it: ``config.json``, bf16 weights in sharded
safetensors with ``model.safetensors.index.json``, tied embeddings where the release ties them.
A Qwen3.6 (hybrid) preset is a ``Qwen3_5ForConditionalGeneration`` checkpoint: its text model
under ``model.language_model.``, beside a few tensors of a vision tower and an MTP layer in their
real shapes (the loader must skip them; their full size would only cost disk). The Gemma 4 12B
preset is the release's ``Gemma4UnifiedForConditionalGeneration``, its vision and audio embedders
beside the text model, with DeepSeek's Gemma 4 draft (``dspark_gemma4_12b_block7``) beside it. ``--layers N``
keeps the first ``N`` layers of the release's pattern, a slice to build and time here.
The draft has the shape of DeepSeek's released DSpark drafts (``deepseek-ai/dspark_qwen3_4b_block7``):
a native DeepSpec config that is the target's with the DSpark fields overwritten
(``docs/dspark.md#checkpoint-and-config-conventions``), 5 decoder layers, block 7, Markov rank
256, the full vocabulary, its own ``embed_tokens`` and ``lm_head``, taps spread as in the
releases, and a confidence head. Only the shapes are real: the
weights are random, so these pairs measure time and memory, never acceptance.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported where a pair is written, not where the command line lists the presets


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    num_key_value_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 151936
    linear: dict | None = None   # a Qwen3.5 / 3.6 hybrid's gated-DeltaNet fields
    moe: dict | None = None      # a MoE target's expert fields
    gemma4: dict | None = None   # a Gemma 4 target's fields beyond the dense decoder's

    def shape(self) -> dict:
        """The config fields that are plain numbers (not the family's groups)."""
        return {k: v for k, v in asdict(self).items() if k not in ("linear", "moe", "gemma4")}


# Qwen3.6-27B's config.json (text_config): 64 layers, every fourth full attention
QWEN3_6_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                      linear_num_key_heads=16, linear_num_value_heads=48)
# Qwen3.6-35B-A3B's: 40 layers, 256 experts (top 8) of 512 and a shared one of 512
QWEN3_6_A3B_LINEAR = dict(QWEN3_6_LINEAR, linear_num_value_heads=32)
QWEN3_6_A3B_MOE = dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                       shared_expert_intermediate_size=512)
# Qwen3-30B-A3B's: 48 layers, 128 experts (top 8, renormalised) of 768
QWEN3_A3B_MOE = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)
# gemma-4-12B-it's text_config (Gemma4UnifiedForConditionalGeneration): 48 layers, five sliding (window
# 1024, 8 KV heads of 256) to one full (1 KV head of 512, V = K, proportional RoPE); soft-capped logits
GEMMA4_12B = dict(global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=True,
                  sliding_window=1024, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
                  max_position_embeddings=262144, use_bidirectional_attention="vision",
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                                      "partial_rotary_factor": 0.25}})


# the Qwen3 releases' config.json shapes
PRESETS = {
    "qwen3-0.6b": Preset(1024, 28, 16, 3072, tie_word_embeddings=True),
    "qwen3-1.7b": Preset(2048, 28, 16, 6144, tie_word_embeddings=True),
    "qwen3-4b": Preset(2560, 36, 32, 9728, tie_word_embeddings=True),
    "qwen3-8b": Preset(4096, 36, 32, 12288, tie_word_embeddings=False),
    "qwen3-32b": Preset(5120, 64, 64, 25600, tie_word_embeddings=False),
    "qwen3.6-27b": Preset(5120, 64, 24, 17408, tie_word_embeddings=False, num_key_value_heads=4,
                          head_dim=256, vocab_size=248320, linear=QWEN3_6_LINEAR),
    "qwen3.6-35b-a3b": Preset(2048, 40, 16, 512, tie_word_embeddings=False, num_key_value_heads=2,
                              head_dim=256, vocab_size=248320, linear=QWEN3_6_A3B_LINEAR,
                              moe=QWEN3_6_A3B_MOE),
    "qwen3-30b-a3b": Preset(2048, 48, 32, 6144, tie_word_embeddings=False, num_key_value_heads=4,
                            moe=QWEN3_A3B_MOE),
    "gemma4-12b": Preset(3840, 48, 16, 15360, tie_word_embeddings=True, num_key_value_heads=8, head_dim=256,
                         vocab_size=262144, gemma4=GEMMA4_12B),
}
# DeepSeek's dspark_gemma4_12b_block7 (DeepSpec's config/dspark/dspark_gemma4_12b.py)
GEMMA4_DRAFT = dict(taps=[5, 17, 29, 41, 46], mask_token_id=4)
DRAFT_LAYERS, BLOCK_SIZE, MARKOV_RANK, MASK_TOKEN_ID = 5, 7, 256, 151669
SHARD_SIZE = "4GB"   # the Qwen3 releases' shards are about this size
SCALE = 0.02         # the releases' initializer_range: activations stay finite through every layer


def make_preset(out: Path, name: str, seed: int = 0, layers: int | None = None,
                vocab: int | None = None) -> tuple[Path, Path]:
    """Write ``out/target`` and ``out/draft`` in the shapes of preset ``name``, the target cut to
    its first ``layers`` layers if given, and to a vocabulary of ``vocab`` ids (a benchmark of the
    layers whose fp32 embeddings would not fit in memory); returns their paths."""
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r}: expected one of {', '.join(PRESETS)}")
    preset = PRESETS[name]
    if layers is not None:
        if not 1 <= layers <= preset.num_hidden_layers:
            raise ValueError(f"--layers {layers}: expected 1 .. {preset.num_hidden_layers} (the layers "
                             f"of {name})")
        preset = replace(preset, num_hidden_layers=layers)
    if vocab is not None:
        preset = replace(preset, vocab_size=vocab)
    import torch

    torch.manual_seed(seed)
    if preset.gemma4:
        target = _write_gemma4_target(out / "target", preset)
        _write_gemma4_draft(out / "draft", target, full=layers is None)
        return out / "target", out / "draft"
    write = _write_hybrid_target if preset.linear else _write_target   # Qwen3.5 / 3.6, or Qwen3 (-MoE)
    target = write(out / "target", preset)
    _write_draft(out / "draft", target)
    return out / "target", out / "draft"


def release_taps(num_layers: int, count: int = 5) -> list[int]:
    """Taps spread from layer 1 to layer ``N - 3`` as in the releases: ``[1, 9, 17, 25, 33]`` of 36."""
    step = (num_layers - 4) / (count - 1)
    return [int(1 + i * step + 0.5) for i in range(count)]


def _random(shape, name: str) -> torch.Tensor:
    """bf16 weights as a release stores them: norms at one, matrices small and random."""
    import torch

    if name.endswith(("norm.weight", "layer_scalar")):
        return torch.ones(shape, dtype=torch.bfloat16)
    return torch.randn(shape, dtype=torch.bfloat16) * SCALE


def _write_target(directory: Path, preset: Preset) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe" if preset.moe else "qwen3", **preset.shape(), **(preset.moe or {}),
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 1000000.0},
        eos_token_id=1, pad_token_id=0, bos_token_id=None, dtype="bfloat16",
        architectures=["Qwen3MoeForCausalLM" if preset.moe else "Qwen3ForCausalLM"])
    with torch.device("meta"):
        shapes = _per_expert({name: p.shape for name, p in
                              AutoModelForCausalLM.from_config(config).state_dict().items()})
    if preset.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return _save(directory, shapes, config)


def _save(directory: Path, shapes: dict, config) -> dict:
    """Random weights of ``shapes`` in shards, ``config`` and the tokenizer as a release ships
    them; returns the config as written."""
    from huggingface_hub import save_torch_state_dict

    from .checkpoint import match_config_mode
    from .tiny import _tokenizer

    directory.mkdir(parents=True)
    save_torch_state_dict({name: _random(shape, name) for name, shape in shapes.items()}, directory,
                          max_shard_size=SHARD_SIZE)
    config.save_pretrained(directory)
    match_config_mode(directory)
    _tokenizer().save_pretrained(directory)
    return json.loads((directory / "config.json").read_text())


def _write_hybrid_target(directory: Path, preset: Preset) -> dict:
    """The ``Qwen3_5ForConditionalGeneration`` layout; returns the text config."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    family = "Qwen3_5Moe" if preset.moe else "Qwen3_5"
    shape = preset.shape()
    if preset.moe:   # every layer a MoE block: no dense MLP width
        shape.pop("intermediate_size")
    text = getattr(transformers, f"{family}TextConfig")(
        **shape, **preset.linear, **(preset.moe or {}), max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        eos_token_id=1, pad_token_id=0, bos_token_id=None, dtype="bfloat16")
    config = getattr(transformers, f"{family}Config")(
        text_config=text.to_dict(), tie_word_embeddings=preset.tie_word_embeddings, dtype="bfloat16",
        architectures=[f"{family}ForConditionalGeneration"])
    with torch.device("meta"):
        text_shapes = _per_expert({name: p.shape for name, p in
                                   AutoModelForCausalLM.from_config(text).state_dict().items()})
    shapes = {name.replace("model.", "model.language_model.", 1): size for name, size in text_shapes.items()}
    # what the loader skips: a vision patch embedding and an MTP layer's norms and projection
    shapes |= {"model.visual.patch_embed.proj.weight": (1152, 3, 2, 16, 16),
               "mtp.pre_fc_norm_embedding.weight": (preset.hidden_size,),
               "mtp.fc.weight": (preset.hidden_size, 2 * preset.hidden_size)}
    return _save(directory, shapes, config)["text_config"]


def gemma4_layer_types(layers: int) -> list[str]:
    """The release's 5:1 sliding:full pattern over ``layers``, ending on a full layer as
    ``transformers`` makes every Gemma 4 end."""
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    return [*types[:-1], "full_attention"]


def _write_gemma4_target(directory: Path, preset: Preset) -> dict:
    """The ``Gemma4UnifiedForConditionalGeneration`` layout, its vision and audio embedders
    beside the text model in their real shapes; a slice keeps the first layers of the 5:1
    pattern and ends on a full layer, as ``transformers`` makes every Gemma 4 end. Returns the
    text config."""
    import torch
    import transformers

    text = transformers.Gemma4UnifiedTextConfig(
        **preset.shape(), **preset.gemma4, layer_types=gemma4_layer_types(preset.num_hidden_layers),
        rms_norm_eps=1e-6, eos_token_id=1,
        pad_token_id=0, bos_token_id=None, dtype="bfloat16")
    config = transformers.Gemma4UnifiedConfig(text_config=text.to_dict(), tie_word_embeddings=True,
                                              dtype="bfloat16",
                                              architectures=["Gemma4UnifiedForConditionalGeneration"])
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in
                  transformers.Gemma4UnifiedForConditionalGeneration(config).state_dict().items()}
    shapes.pop("lm_head.weight")   # tied
    return _save(directory, shapes, config)["text_config"]


def _write_gemma4_draft(directory: Path, target: dict, full: bool) -> None:
    """DeepSeek's Gemma 4 12B draft's shape: DeepSpec's config (the target's, ``build_draft_config``)
    with 5 layers of the full attention's heads, block 7, its own embedding and ``lm_head``; its
    taps where the release has them, spread over a slice."""
    from huggingface_hub import save_torch_state_dict

    from .checkpoint import match_config_mode
    from .draft_config import gemma4_native_config, load_draft_config
    from .draft_model import DraftStep

    layers = target["num_hidden_layers"]
    taps = GEMMA4_DRAFT["taps"] if full else (release_taps(layers) if layers >= 8 else
                                              list(range(-1, layers - 1))[-5:])
    config = gemma4_native_config(target, layers=DRAFT_LAYERS, block_size=BLOCK_SIZE, taps=taps,
                                  mask_token_id=GEMMA4_DRAFT["mask_token_id"], markov_rank=MARKOV_RANK,
                                  num_anchors=512)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    draft = load_draft_config(directory, layers, target["hidden_size"])
    import torch

    with torch.device("meta"):
        shapes = {name: t.shape for name, t in DraftStep(draft, target["vocab_size"], 1).state_dict().items()
                  if name != "d2t"}
    shapes |= {"confidence_head.proj.weight": (1, target["hidden_size"] + MARKOV_RANK),
               "confidence_head.proj.bias": (1,)}
    save_torch_state_dict({name: _random(shape, name) for name, shape in shapes.items()}, directory,
                          max_shard_size=SHARD_SIZE)
    match_config_mode(directory)


def _per_expert(shapes: dict) -> dict:
    """The experts stored one by one, as the releases store them (``transformers`` holds them fused
    in memory: ``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``)."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix, (experts, double, hidden) = name.removesuffix("gate_up_proj"), shape
            for e in range(experts):
                out |= {f"{prefix}{e}.{kind}.weight": (double // 2, hidden)
                        for kind in ("gate_proj", "up_proj")}
        elif name.endswith(".experts.down_proj"):
            prefix, (experts, hidden, size) = name.removesuffix("down_proj"), shape
            out |= {f"{prefix}{e}.down_proj.weight": (hidden, size) for e in range(experts)}
        else:
            out[name] = shape
    return out


def _write_draft(directory: Path, target: dict) -> None:
    from huggingface_hub import save_torch_state_dict

    from .checkpoint import match_config_mode
    from .draft_config import native_config

    hidden, vocab = target["hidden_size"], target["vocab_size"]
    layers = target["num_hidden_layers"]
    # a slice too short to spread 5 taps over takes its last layers (not the final one) and the embeddings
    taps = release_taps(layers) if layers >= 8 else list(range(-1, layers - 1))[-5:]
    # a dense Qwen3 backbone: it rotates whole heads (not a hybrid's partial rotary), and an all-MoE
    # target (Qwen3.6-35B-A3B) names no dense MLP width to copy: three times the hidden size
    target = {**target, "rope_parameters": {"rope_type": "default",
                                            "rope_theta": target["rope_parameters"]["rope_theta"]},
              "intermediate_size": target.get("intermediate_size") or 3 * hidden}
    config = native_config(target, layers=DRAFT_LAYERS, block_size=BLOCK_SIZE, taps=taps,
                           mask_token_id=min(MASK_TOKEN_ID, vocab - 1), markov_rank=MARKOV_RANK,
                           num_anchors=512, confidence_head=True)
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim, intermediate = target["head_dim"], target["intermediate_size"]
    shapes = {"embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "fc.weight": (hidden, len(taps) * hidden), "hidden_norm.weight": (hidden,),
              "norm.weight": (hidden,), "markov_head.markov_w1.weight": (vocab, MARKOV_RANK),
              "markov_head.markov_w2.weight": (vocab, MARKOV_RANK),
              "confidence_head.proj.weight": (1, hidden + MARKOV_RANK), "confidence_head.proj.bias": (1,)}
    for layer in range(DRAFT_LAYERS):
        shapes |= {f"layers.{layer}.{name}": shape for name, shape in (
            ("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,)),
            ("self_attn.q_proj.weight", (heads * head_dim, hidden)),
            ("self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            ("self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            ("self_attn.o_proj.weight", (hidden, heads * head_dim)),
            ("self_attn.q_norm.weight", (head_dim,)), ("self_attn.k_norm.weight", (head_dim,)),
            ("mlp.gate_proj.weight", (intermediate, hidden)), ("mlp.up_proj.weight", (intermediate, hidden)),
            ("mlp.down_proj.weight", (hidden, intermediate)))}
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # in shards, as the target: one file would be serialized whole in memory beside the tensors
    save_torch_state_dict({name: _random(shape, name) for name, shape in shapes.items()}, directory,
                          max_shard_size=SHARD_SIZE)
    match_config_mode(directory)
