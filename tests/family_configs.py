"""Tiny configs of every supported target architecture, each with its family's features on, saved by
the ``transformers`` that runs this: the version we pin in the tests, and DeepSpec's (5.10.2) once,
into ``tests/data/configs/transformers-5.10.2`` (``test_family_configs.py`` reads both):

    python3 -m venv /tmp/ds-venv && /tmp/ds-venv/bin/pip install torch==2.13.0 transformers==5.10.2
    /tmp/ds-venv/bin/python tests/family_configs.py tests/data/configs/transformers-5.10.2
"""
from __future__ import annotations

import sys
from pathlib import Path

SHAPES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=1,
              tie_word_embeddings=False)
HYBRID = dict(SHAPES, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
              linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA4 = dict(SHAPES, num_hidden_layers=5, sliding_window=8, global_head_dim=32,
              final_logit_softcapping=30.0, layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL],
              num_kv_shared_layers=2, use_double_wide_mlp=True, tie_word_embeddings=True)


def configs() -> dict[str, tuple[str, dict]]:
    """name -> (transformers config class, its arguments); ``architectures`` is the name's prefix."""
    gemma4 = dict(GEMMA4, hidden_size_per_layer_input=8, vocab_size_per_layer_input=256)
    return {
        "LlamaForCausalLM": ("LlamaConfig", dict(
            SHAPES, num_hidden_layers=2, attention_bias=True, mlp_bias=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64})),
        "Qwen3ForCausalLM": ("Qwen3Config", dict(
            SHAPES, num_hidden_layers=2,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                             "original_max_position_embeddings": 128})),
        "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(SHAPES, num_hidden_layers=2, norm_topk_prob=True,
                                                       **EXPERTS)),
        "Qwen3_5ForCausalLM": ("Qwen3_5TextConfig", HYBRID),
        "Qwen3_5ForConditionalGeneration": ("Qwen3_5Config", {"text_config": HYBRID}),
        "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeTextConfig", dict(HYBRID, shared_expert_intermediate_size=48,
                                                               **EXPERTS)),
        "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeConfig", {"text_config": dict(
            HYBRID, shared_expert_intermediate_size=48, **EXPERTS)}),
        # num_global_key_value_heads left at its default (5.10.2 writes null): the full layers keep the
        # sliding layers' kv heads
        "Gemma4ForCausalLM": ("Gemma4TextConfig", gemma4),
        "Gemma4ForCausalLM-k-eq-v": ("Gemma4TextConfig", dict(gemma4, attention_k_eq_v=True,
                                                              num_global_key_value_heads=1)),
        "Gemma4ForCausalLM-moe": ("Gemma4TextConfig", dict(gemma4, enable_moe_block=True, num_experts=4,
                                                           top_k_experts=2, moe_intermediate_size=32)),
        "Gemma4ForConditionalGeneration": ("Gemma4Config", {"text_config": gemma4}),
        "Gemma4UnifiedForCausalLM": ("Gemma4UnifiedTextConfig", GEMMA4),
        "Gemma4UnifiedForConditionalGeneration": ("Gemma4UnifiedConfig", {"text_config": GEMMA4}),
    }


def save_configs(out: Path) -> list[Path]:
    """Each of ``configs()`` saved by the installed ``transformers`` into ``out/NAME``."""
    import transformers

    written = []
    for name, (class_name, arguments) in configs().items():
        config = getattr(transformers, class_name)(**arguments)
        config.architectures = [name.split("-")[0]]
        config.save_pretrained(out / name)
        written.append(out / name)
    return written


if __name__ == "__main__":
    save_configs(Path(sys.argv[1]))
