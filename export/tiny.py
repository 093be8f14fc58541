"""Tiny target / draft pairs in the real on-disk layouts, for tests and the quick start.

The target is a ``transformers`` Qwen3 or Llama model saved with ``save_pretrained`` (plus a
character-level tokenizer with a chat template); the draft is a DSpark checkpoint in the native
DeepSpec or the Speculators layout. Weights are random with randomised norm weights (HF initialises
norms to 1, which would hide a miswired norm) and a wide enough spread that greedy choices are not
near-ties.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .layouts import ANCHOR_FIRST, BONUS_ANCHOR, LAYOUTS

if TYPE_CHECKING:
    import torch

# torch is imported where a pair is written, not where the command line lists the architectures

SPECIALS = ["<unk>", "<eos>", "<mask>", "<|user|>", "<|assistant|>"]
CHARACTERS = list("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?'\n0123456789+-*/=()$:;\"")
VOCAB = len(SPECIALS) + len(CHARACTERS)
MAX_POSITIONS = 1024
ARCHS = ("qwen3", "llama", "qwen3_moe", "qwen3_5", "qwen3_5-multimodal", "qwen3_5_moe-multimodal", "gemma4",
         "gemma4-multimodal", "gemma4_unified-multimodal")
# a Gemma 4 target with every feature on: windows of 4 rows (crossed by any real prompt), full
# layers with their own head size, one KV head and V = K, per-layer inputs, two KV-shared layers
# with double-wide MLPs, soft-capped logits
GEMMA4 = dict(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3, sliding_window=4,
              global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
              num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
              final_logit_softcapping=10.0, hidden_activation="gelu_pytorch_tanh",
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                  "rope_theta": 1000000.0}})
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


@dataclass(frozen=True)
class TinySpec:
    arch: str = "qwen3"                 # qwen3 (untied embeddings), llama (tied), qwen3_moe (one dense
                                        # layer among MoE ones) or a hybrid: qwen3_5
                                        # (Qwen3_5ForCausalLM), qwen3_5-multimodal (its
                                        # ForConditionalGeneration layout, a vision tower beside it),
                                        # qwen3_5_moe-multimodal (the same with MoE blocks);
                                        # gemma4 (Gemma4ForCausalLM, every feature on),
                                        # gemma4-multimodal (Gemma4ForConditionalGeneration) and
                                        # gemma4_unified-multimodal (the 12B's layout: no
                                        # per-layer inputs, vision and audio embedders beside it)
    draft_format: str = "native"        # native or speculators
    draft_vocab: int | None = None      # < target vocab gives a reduced vocabulary with d2t
    layout: str = ANCHOR_FIRST
    block_size: int = 4
    taps: tuple[int, ...] = (0, 2)      # DeepSpec convention
    seed: int = 0

    def __post_init__(self):
        """Refuse, by the make-tiny flag, a pair that could not be written or loaded, before any
        file is."""
        if self.arch not in ARCHS:
            raise ValueError(f"--arch {self.arch!r}: expected one of {', '.join(ARCHS)}")
        if self.draft_format not in ("native", "speculators"):
            raise ValueError(f"--draft-format {self.draft_format!r}: expected native or speculators")
        if self.layout not in LAYOUTS:
            raise ValueError(f"--layout {self.layout!r}: expected {ANCHOR_FIRST} or {BONUS_ANCHOR}")
        if not 2 <= self.block_size <= MAX_POSITIONS:
            raise ValueError(f"--block-size {self.block_size}: expected an integer from 2 to "
                             f"{MAX_POSITIONS} (the anchor and at least one MASK slot, within the "
                             f"tiny target's positions)")
        if self.arch.startswith("gemma4") and (self.draft_format != "native" or self.draft_vocab is not None):
            raise ValueError(f"--arch {self.arch}: its draft is DeepSpec's Gemma4DSparkModel, native and "
                             f"with the full vocabulary (no --draft-format speculators, no --draft-vocab)")
        if self.draft_vocab is not None and not len(SPECIALS) <= self.draft_vocab <= VOCAB:
            raise ValueError(f"--draft-vocab {self.draft_vocab}: expected {len(SPECIALS)}..{VOCAB} "
                             f"(the special tokens up to the whole target vocabulary)")


def make_tiny(out: Path, spec: TinySpec = TinySpec()) -> tuple[Path, Path]:
    """Write ``out/target`` and ``out/draft``; returns their paths."""
    import torch

    torch.manual_seed(spec.seed)
    target_dir, draft_dir = out / "target", out / "draft"
    target_config = _write_target(target_dir, spec)
    write_draft(draft_dir, target_config, spec)
    return target_dir, draft_dir


def _tokenizer():
    """One token per character, written as a byte-level BPE without merges (as released
    tokenizers are): ``transformers`` 5.24 rebuilds a Qwen3.5 checkpoint's tokenizer as byte-level
    BPE whatever its tokenizer.json says, and this one reads the same there, in 5.10.2 and for every
    other family (docs/families.md)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte-to-character map: printable ASCII is itself, space and newline are U+0120, U+010A
    characters = [c if 33 <= ord(c) <= 126 else chr(256 + ord(c)) for c in CHARACTERS]
    vocab = {token: i for i, token in enumerate(SPECIALS + characters)}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        eos_token="<eos>", mask_token="<mask>", pad_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[3:]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _write_target(directory: Path, spec: TinySpec) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from .checkpoint import match_config_mode

    tokenizer = _tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, eos_token_id=1, pad_token_id=0,
                  bos_token_id=None, initializer_range=0.25)
    if spec.arch == "qwen3":
        config = AutoConfig.for_model("qwen3", tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                      **common)
    elif spec.arch == "llama":
        config = AutoConfig.for_model("llama", tie_word_embeddings=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                                      **common)
    elif spec.arch == "gemma4_unified-multimodal":
        unified = {k: v for k, v in GEMMA4.items() if k != "hidden_size_per_layer_input"}
        config = AutoConfig.for_model("gemma4_unified_text", tie_word_embeddings=True,
                                      **{**common, **unified})
    elif spec.arch.startswith("gemma4"):
        config = AutoConfig.for_model("gemma4_text", tie_word_embeddings=True,
                                      vocab_size_per_layer_input=len(tokenizer),
                                      **{**common, **GEMMA4})
    elif spec.arch == "qwen3_moe":   # 8 experts, top 2, renormalised; layer 1 a dense MLP
        config = AutoConfig.for_model("qwen3_moe", tie_word_embeddings=False, moe_intermediate_size=32,
                                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                      mlp_only_layers=[1],
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                      **common)
    else:   # three linear-attention layers, then a full one; grouped value heads
        moe = "moe" in spec.arch
        extra = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                     num_experts_per_tok=2) if moe else dict(intermediate_size=common["intermediate_size"])
        config = AutoConfig.for_model(
            "qwen3_5_moe_text" if moe else "qwen3_5_text", tie_word_embeddings=False,
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_num_key_heads=2, linear_num_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            **extra, **{k: v for k, v in common.items() if k != "intermediate_size"})
    if spec.arch == "gemma4_unified-multimodal":
        import transformers

        outer = transformers.Gemma4UnifiedConfig(
            text_config=config.to_dict(), audio_config=dict(audio_embed_dim=16),
            vision_config=dict(patch_size=4, mm_embed_dim=64, mm_posemb_size=16, output_proj_dims=64))
        model = transformers.Gemma4UnifiedForConditionalGeneration(outer).float()
    elif spec.arch == "gemma4-multimodal":   # a vision tower beside the text model
        import transformers

        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64)
        outer = transformers.Gemma4Config(text_config=config.to_dict(), vision_config=vision,
                                          audio_config=None)
        model = transformers.Gemma4ForConditionalGeneration(outer).float()
    elif spec.arch.endswith("-multimodal"):
        import transformers

        family = "Qwen3_5Moe" if "moe" in spec.arch else "Qwen3_5"
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=4, num_position_embeddings=16)
        outer = getattr(transformers, f"{family}Config")(text_config=config.to_dict(), vision_config=vision)
        model = getattr(transformers, f"{family}ForConditionalGeneration")(outer).float()
    else:
        model = AutoModelForCausalLM.from_config(config).float()
    _randomise_norms(model)
    if spec.arch.startswith("gemma4"):
        import torch

        # Gemma ties its lm_head to the embedding, which is scaled by sqrt(hidden) into the residual
        # stream: at random weights the input token's own row would win every step, and the tiny
        # model would repeat it; a smaller embedding lets the layers decide (33 distinct tokens of 40)
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(0.1)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    match_config_mode(directory)
    saved = json.loads((directory / "config.json").read_text())
    return saved.get("text_config", saved)


def _randomise_norms(module: torch.nn.Module) -> None:
    """Norm weights, and routers, which transformers initialises to zero (every expert tied);
    Gemma 4's per-layer output scales (``layer_scalar``, ones)."""
    import torch

    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                parameter.normal_(0, 1.0)
        for name, buffer in module.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)


def write_draft(directory: Path, target: dict, spec: TinySpec) -> None:
    """A random DSpark draft for the target whose config.json is ``target``, laid out as ``spec``
    says (format, layout, block size, taps, reduced vocabulary)."""
    import torch

    from .checkpoint import write_tensors
    from .draft_config import native_config

    # a dense Qwen3 backbone: an all-MoE target (Qwen3.5-MoE) names no dense MLP width to copy
    target = {**target, "intermediate_size": target.get("intermediate_size", 128)}
    vocab, hidden = target["vocab_size"], target["hidden_size"]
    draft_vocab = spec.draft_vocab or vocab
    markov_rank, mask_token_id = 8, SPECIALS.index("<mask>")
    reduced = draft_vocab if draft_vocab < vocab else None

    if spec.arch.startswith("gemma4"):
        _write_gemma4_draft(directory, target, spec, markov_rank, mask_token_id)
        return
    if spec.draft_format == "native":
        # a Qwen3 backbone rotates whole heads: not the hybrid target's partial rotary
        target = {**target, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
        config = native_config(target, layers=1, block_size=spec.block_size, taps=spec.taps,
                               mask_token_id=mask_token_id, markov_rank=markov_rank, num_anchors=64,
                               draft_vocab_size=reduced, confidence_head=True,
                               bonus_anchor=spec.layout == BONUS_ANCHOR)
    else:
        backbone = {key: target[key] for key in (
            "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "max_position_embeddings", "vocab_size", "rope_parameters", "eos_token_id")}
        backbone.update(model_type="qwen3", num_hidden_layers=1, attention_bias=False,
                        tie_word_embeddings=False, layer_types=["full_attention"], hidden_act="silu")
        dspark = dict(block_size=spec.block_size, mask_token_id=mask_token_id, markov_rank=markov_rank,
                      markov_head_type="vanilla", enable_confidence_head=True,
                      confidence_head_with_markov=True)
        if reduced is not None:
            dspark["draft_vocab_size"] = reduced
        drafts = spec.block_size if spec.layout == ANCHOR_FIRST else spec.block_size - 1
        config = dict(speculators_model_type="dspark", architectures=["DSparkSpeculator"],
                      transformer_layer_config=backbone,
                      aux_hidden_state_layer_ids=[t + 1 for t in spec.taps],  # vLLM capture ids
                      target_hidden_size=hidden, sample_from_anchor=spec.layout == ANCHOR_FIRST,
                      speculators_config={"proposal_methods": [{"proposal_type": "dspark",
                                                                "speculative_tokens": drafts}],
                                          "verifier": {"name_or_path": "tiny-target"}},
                      **dspark)

    tensors = _draft_tensors(hidden, len(spec.taps), target["intermediate_size"],
                             target["num_attention_heads"], target["num_key_value_heads"],
                             target["head_dim"], vocab, draft_vocab, markov_rank)
    if spec.draft_format == "speculators":
        # Speculators exports carry their own embedding: exercise loading it rather than sharing.
        tensors["embed_tokens.weight"] = torch.randn(vocab, hidden) * 0.25
    directory.mkdir(parents=True, exist_ok=True)
    write_tensors(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _write_gemma4_draft(directory: Path, target: dict, spec: TinySpec, rank: int, mask_token_id: int) -> None:
    """A native ``Gemma4DSparkModel`` draft, one layer, sharing the target's embedding and
    ``lm_head``: its tensors are those the loader's module holds, random."""
    import torch

    from .checkpoint import write_tensors
    from .draft_config import gemma4_native_config, load_draft_config
    from .draft_model import DraftStep

    config = gemma4_native_config(target, layers=1, block_size=spec.block_size, taps=spec.taps,
                                  mask_token_id=mask_token_id, markov_rank=rank, num_anchors=64)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    draft = load_draft_config(directory, target["num_hidden_layers"], target["hidden_size"])
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in DraftStep(draft, target["vocab_size"], 1).state_dict().items()
                  if name not in ("d2t", "embed_tokens.weight", "lm_head.weight")}
    tensors = {}
    for name, shape in shapes.items():
        if "norm" in name or name.endswith("layer_scalar"):
            tensors[name] = torch.rand(shape) + 0.5
        elif name == "markov_head.markov_w1.weight":
            tensors[name] = torch.randn(shape)
        else:
            tensors[name] = torch.randn(shape) * shape[-1] ** -0.5
    hidden = target["hidden_size"]
    tensors |= {"confidence_head.proj.weight": torch.randn(1, hidden + rank) * hidden ** -0.5,
                "confidence_head.proj.bias": torch.zeros(1)}
    write_tensors(tensors, directory / "model.safetensors")


def _draft_tensors(hidden, taps, intermediate, heads, kv_heads, head_dim, vocab, draft_vocab, rank):
    import torch

    def linear(out_features, in_features):
        return torch.randn(out_features, in_features) * in_features ** -0.5

    def norm(size):
        return torch.rand(size) + 0.5

    t = {"fc.weight": linear(hidden, taps * hidden), "hidden_norm.weight": norm(hidden),
         "norm.weight": norm(hidden),
         "markov_head.markov_w1.weight": torch.randn(vocab, rank),
         "markov_head.markov_w2.weight": linear(draft_vocab, rank),
         "confidence_head.proj.weight": linear(1, hidden + rank),
         "confidence_head.proj.bias": torch.zeros(1)}
    layer = "layers.0."
    t |= {layer + "input_layernorm.weight": norm(hidden),
          layer + "post_attention_layernorm.weight": norm(hidden),
          layer + "self_attn.q_proj.weight": linear(heads * head_dim, hidden),
          layer + "self_attn.k_proj.weight": linear(kv_heads * head_dim, hidden),
          layer + "self_attn.v_proj.weight": linear(kv_heads * head_dim, hidden),
          layer + "self_attn.o_proj.weight": linear(hidden, heads * head_dim),
          layer + "self_attn.q_norm.weight": norm(head_dim),
          layer + "self_attn.k_norm.weight": norm(head_dim),
          layer + "mlp.gate_proj.weight": linear(intermediate, hidden),
          layer + "mlp.up_proj.weight": linear(intermediate, hidden),
          layer + "mlp.down_proj.weight": linear(hidden, intermediate)}
    if draft_vocab < vocab:
        # keep the special tokens, then a random subset; d2t holds offsets (target = draft + d2t)
        rest = torch.randperm(vocab - len(SPECIALS))[: draft_vocab - len(SPECIALS)] + len(SPECIALS)
        kept = torch.cat([torch.arange(len(SPECIALS)), rest.sort().values])[:draft_vocab]
        t["lm_head.weight"] = linear(draft_vocab, hidden)
        t["d2t"] = kept - torch.arange(draft_vocab)
        t["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, kept, True)
    return t
