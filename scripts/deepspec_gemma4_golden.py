"""Record the Gemma 4 golden case (tests/data/golden/dspark-gemma4-tiny) with DeepSpec's own code.

DeepSpec's Gemma 4 draft needs the transformers it pins (5.10.2), not this project's, so this runs
in an environment of its own, with a DeepSpec checkout on the path; nothing of DeepSpec is copied:

    python3 -m venv /tmp/ds-venv
    /tmp/ds-venv/bin/pip install torch==2.13.0 transformers==5.10.2 safetensors tokenizers
    git -C DEEPSPEC_CHECKOUT archive HEAD deepspec | tar -x -C /tmp/deepspec
    PYTHONPATH=/tmp/deepspec:. /tmp/ds-venv/bin/python scripts/deepspec_gemma4_golden.py OUT

It writes OUT/target (a tiny ``Gemma4ForConditionalGeneration`` saved by transformers 5.10.2, in
the release's config format: ``global_head_dim``, ``num_global_key_value_heads``), OUT/draft-deepspec
(a ``Gemma4DSparkModel`` built by DeepSpec's ``build_draft_config`` and saved by its
``save_pretrained``, distilled briefly on the target's own greedy text so that drafts get
accepted) and OUT/expected.jsonl: per prompt, transformers' greedy output and, step by step,
what DeepSpec's evaluator (``Gemma4DSparkEvaluator``, its propose / verify loop at temperature 0)
proposed and accepted.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

PROMPTS = ["the cat sat on", "Numbers: 1, 2, 3,", "Why is the sky blue? Because"]
NEW_TOKENS = 32
TAPS = [1, 3]
BLOCK = 4


def tiny_target(out: Path):
    import transformers

    from modeling.fixtures.tiny import _tokenizer

    tokenizer = _tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=4,
                layer_types=["sliding_attention", "full_attention"] * 3, num_kv_shared_layers=1,
                use_double_wide_mlp=True, hidden_size_per_layer_input=0, final_logit_softcapping=10.0,
                max_position_embeddings=1024, rms_norm_eps=1e-6, eos_token_id=1, pad_token_id=0,
                bos_token_id=None, initializer_range=0.25, tie_word_embeddings=True)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                                       tie_word_embeddings=True)
    model = transformers.Gemma4ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                             attn_implementation="sdpa").eval(), tokenizer


def deepspec_draft(target_config, target):
    from deepspec.modeling.dspark.gemma4 import Gemma4DSparkModel
    from deepspec.modeling.dspark.gemma4.config import build_draft_config

    args = _Args(num_draft_layers=2, target_layer_ids=TAPS, confidence_head_alpha=1.0,
                 confidence_head_with_markov=True, markov_rank=8, markov_head_type="vanilla",
                 block_size=BLOCK, mask_token_id=2, num_anchors=64)
    config = build_draft_config(target_config, args)
    draft = Gemma4DSparkModel(config).float()
    with torch.no_grad():
        for name, parameter in draft.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0, 0.25)
        for name, buffer in draft.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
        language = target.model.language_model
        draft.initialize_embeddings_and_head(embed_tokens=language.embed_tokens, lm_head=target.lm_head,
                                             freeze=True)
    return draft


class _Args(dict):
    """DeepSpec reads its model arguments both as attributes and with ``in``."""

    def __getattr__(self, name):
        return self[name]


def target_hidden(target, ids):
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[t + 1] for t in TAPS], dim=-1)


def distill(draft, target, tokenizer, steps=400):
    """Train the draft briefly on the target's own greedy continuations (DeepSpec's forward and
    its cross-entropy on the block labels), so that a verify step accepts some drafts."""
    generator = torch.Generator().manual_seed(0)
    texts = []
    for _ in range(24):
        prompt = torch.randint(5, len(tokenizer), (1, 6), generator=generator)
        with torch.no_grad():
            texts.append(target.generate(prompt, max_new_tokens=58, do_sample=False, eos_token_id=None))
    # DeepSpec trains with flex attention, which has no backward on the CPU: the same mask, dense
    from deepspec.modeling.dspark.gemma4 import modeling
    from torch.nn.attention.flex_attention import create_mask

    def dense_flex_attention(q, k, v, block_mask, scale):
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    modeling.flex_attention = dense_flex_attention
    parameters = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=3e-3)
    draft.train()
    for step in range(steps):
        ids = texts[step % len(texts)]
        hidden = target_hidden(target, ids)
        out = draft(input_ids=ids, target_hidden_states=hidden, loss_mask=torch.ones_like(ids))
        mask = out.eval_mask.bool() if out.eval_mask.dtype != torch.bool else out.eval_mask
        logits = out.draft_logits[mask]
        loss = torch.nn.functional.cross_entropy(logits.float(), out.target_ids[mask])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    return draft.eval()


def trace(target, draft, ids):
    """DeepSpec's evaluator loop, batch 1, temperature 0: every step's anchor, drafts, acceptance."""
    from deepspec.eval.dspark.evaluator import Gemma4DSparkEvaluator

    evaluator = Gemma4DSparkEvaluator.__new__(Gemma4DSparkEvaluator)
    evaluator.target_model, evaluator.draft_model = target, draft
    evaluator.args = SimpleNamespace(temperature=0.0, confidence_threshold=0.0, max_new_tokens=NEW_TOKENS)
    evaluator.confidence_head_recorder = None
    steps = []
    propose = evaluator._propose

    def recording_propose(**kwargs):
        proposal = propose(**kwargs)
        ids = proposal.verify_input_ids[0].tolist()
        steps.append({"anchor": ids[0], "drafts": ids[1:]})
        return proposal

    def recording_post_verify(proposal, verification):
        steps[-1]["accepted"] = int(verification.accepted_draft_tokens)

    evaluator._propose, evaluator._post_verify = recording_propose, recording_post_verify
    result = evaluator.generate_one_sample(input_ids=ids, stop_token_ids=None)
    # DeepSpec's loop verifies once more when the anchor is the last of the NEW_TOKENS tokens
    # (``while start < max_length``); that step's tokens are cut off, and it is not recorded
    emitted, kept = 1, []
    for step in steps:
        if emitted >= NEW_TOKENS:
            break
        kept.append(step)
        emitted += step["accepted"] + 1
    return result.output_ids[0, ids.shape[1]:].tolist(), kept


def main(out: Path) -> None:
    import transformers

    torch.manual_seed(0)
    target, tokenizer = tiny_target(out / "target")
    # the draft's config is built from the target's as DeepSpec's trainer reads it (AutoConfig)
    config = transformers.AutoConfig.from_pretrained(out / "target")
    draft = distill(deepspec_draft(config, target), target, tokenizer)
    draft.save_pretrained(out / "draft-deepspec")
    records = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            greedy = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                     min_new_tokens=NEW_TOKENS)[0, ids.shape[1]:].tolist()
        spec, steps = trace(target, draft, ids)
        records.append({"prompt": prompt, "prompt_ids": ids[0].tolist(), "target_greedy": greedy,
                        "spec_tokens": spec[:NEW_TOKENS], "steps": steps})
        print(prompt, "accepted", [s["accepted"] for s in steps], "equal", greedy == spec[:NEW_TOKENS])
    (out / "expected.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print("transformers", transformers.__version__)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
