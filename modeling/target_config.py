"""The target LLM's configuration, as the family step modules read it (``target_config_reader.py``
reads it from a checkpoint)."""
from __future__ import annotations

from dataclasses import dataclass

from modeling.decoder import DecoderConfig
from modeling.gemma4 import Gemma4Layout
from modeling.moe import MoeConfig
from modeling.qwen3_5 import LinearAttentionConfig


@dataclass(frozen=True)
class TargetConfig:
    architecture: str
    decoder: DecoderConfig
    vocab_size: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    linear: LinearAttentionConfig | None = None   # a hybrid's linear-attention layers
    moe: MoeConfig | None = None                    # a MoE target's sparse blocks
    gemma4: Gemma4Layout | None = None              # a Gemma 4 target's layers beyond decoder's
