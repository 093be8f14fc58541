"""Fuzzing the config.json of a target and of its draft (native and Speculators layouts): every
field is deleted, set to a wrong type (string, list, null, object, bool, float) and out of range
(0, -1, huge), and the pair is loaded. Each mutation either loads or is refused with a one-line
``CheckpointError`` / ``ValueError`` that names the mutated config.json: never another exception.

A mutation that loads is accepted on purpose only when it is listed below with the reason: either
the loaded configuration is exactly the unmutated one (``UNUSED``: a field dspark-trt never
reads, or one whose default is the fixture's value), or the value is a legitimate one that the
pair really is loaded with (``VALID``).
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from modeling.pair import load_pair

SPECULATORS = dict(draft_format="speculators", layout="bonus-anchor")  # as test_checkpoint_loading's
DELETE = object()
MUTATIONS = {"delete": DELETE, "string": "1", "list": [1], "null": None, "object": {"a": 1},
             "true": True, "float": 1.5, "zero": 0, "negative": -1, "huge": 10 ** 12}
# fields the fixture's configs leave out, that a checkpoint may give: set, never deleted
OPTIONAL = {"target": [], "hybrid": [], "moe": [], "gemma4": [],
            "native": ["dspark_bonus_anchor", "sample_from_anchor", "draft_vocab_size", "target_hidden_size"],
            "speculators": ["draft_vocab_size"]}

# field -> why a mutation of it that loads leaves the loaded configuration unchanged
UNUSED = {
    "transformers_version": "provenance only",
    "dtype": "the engine's precision is --dtype's",
    "use_cache": "generation setting of transformers",
    "initializer_range": "training only",
    "attention_dropout": "training only",
    "bos_token_id": "not used: prompts are tokenized by the tokenizer",
    "pad_token_id": "not used: batches are ragged, never padded",
    "enable_confidence_head": "the confidence head is ignored (docs/families.md: supported models)",
    "confidence_head_with_markov": "the confidence head is ignored",
    "num_anchors": "DeepSpec training setting",
    "num_target_layers": "informational; the taps are checked against the target itself",
    "max_window_layers": "sliding-window setting; layer_types (checked) decides",
    "sliding_window": "used only with use_sliding_window; layer_types (checked) decides",
    "use_sliding_window": "layer_types (checked: full attention only) decides",
    "layer_types": "absent or null, transformers derives full attention from use_sliding_window",
    "architectures": "a draft's format is decided by speculators_model_type or architectures; an "
                     "absent target architectures is taken from model_type, as transformers does",
    "speculators_config.verifier": "provenance of a Speculators draft",
    "speculators_config.verifier.name_or_path": "provenance of a Speculators draft",
    "speculators_config.proposal_methods.0.proposal_type": "Speculators' name of the method",
    # absent, these take the default that transformers (or the draft format) documents, as
    # transformers itself would load them; the fixture states the same values
    "hidden_act": "transformers' default silu",
    "attention_bias": "transformers' default false (the weights then have no biases)",
    "rms_norm_eps": "transformers' default 1e-6",
    "rope_parameters": "transformers' default RoPE (theta 10000)",
    "rope_parameters.rope_type": "transformers' default RoPE",
    "rope_parameters.rope_theta": "transformers' default 10000",
    "tie_word_embeddings": "a checkpoint's own lm_head.weight is used either way, as in transformers",
    "eos_token_id": "generation_config.json's eos_token_id is the one used (and checked)",
    "model_type": "a draft backbone is qwen3 unless it says otherwise",
    "markov_head_type": "DSpark's default 'vanilla'",
    "target_hidden_size": "absent or null, the target's own hidden size",
    "draft_vocab_size": "absent or null, the whole target vocabulary",
    # a multimodal hybrid's config.json: the text model's fields sit in text_config
    "image_token_id": "the vision tower is not used", "video_token_id": "the vision tower is not used",
    "vision_start_token_id": "the vision tower is not used",
    "vision_end_token_id": "the vision tower is not used",
    "rope_parameters.mrope_section": "multimodal positions: a text-only prompt's are equal in every section",
    "rope_parameters.mrope_interleaved": "multimodal positions: as mrope_section",
    "rope_parameters.partial_rotary_factor": "absent, transformers' Qwen3.5 default 0.25",
    # a Qwen3-MoE config.json
    "head_dim": "absent, Qwen3-MoE derives hidden_size / num_attention_heads (the fixture's value)",
    "decoder_sparse_step": "transformers' default 1 (every layer sparse but mlp_only_layers)",
    "output_router_logits": "training only", "router_aux_loss_coef": "training only",
    # a Gemma 4 config.json (and its draft's, a copy of it)
    "audio_token_id": "the audio tower is not used", "boa_token_id": "the audio tower is not used",
    "eoa_token_index": "the audio tower is not used", "boi_token_id": "the vision tower is not used",
    "eoi_token_id": "the vision tower is not used",
    "enable_moe_block": "transformers' default false (true needs the MoE fields, null here: refused)",
    "num_experts": "read only with enable_moe_block (false here)",
    "top_k_experts": "read only with enable_moe_block (false here)",
    "moe_intermediate_size": "read only with enable_moe_block (false here)",
    "hidden_activation": "transformers' default gelu_pytorch_tanh",
    "use_bidirectional_attention": "only 'all' (refused) changes how text attends",
    "rope_parameters.sliding_attention.rope_type": "transformers' default RoPE, the fixture's",
}
# fields of a tower the text model never reads (by prefix)
UNUSED_SECTIONS = ("vision_config", "audio_config")
# (field, mutation) -> why a value that loads and changes the configuration is legitimate
VALID = {
    ("rope_parameters.rope_theta", "float"): "any positive RoPE base is a valid one",
    ("rms_norm_eps", "float"): "any positive epsilon is a valid one",
    ("rope_parameters.rope_theta", "huge"): "any positive RoPE base is a valid one",
    ("max_position_embeddings", "huge"): "a longer context is the checkpoint's claim to make",
    ("max_position_embeddings", "delete"): "transformers' default, as when it loads the checkpoint "
                                           "(a draft's only bounds its block_size)",
    ("mask_token_id", "zero"): "0 is a valid token id for MASK",
    ("block_size", "delete"): "Speculators' documented default block_size 8",
    ("tie_word_embeddings", "true"): "a checkpoint's own lm_head.weight is used, as in transformers",
    ("dspark_bonus_anchor", "true"): "the bonus-anchor layout, spelled the DeepSpec way",
    ("sample_from_anchor", "true"): "the anchor-first layout",
    ("sample_from_anchor", "delete"): "Speculators' documented default true (anchor-first)",
    ("mlp_only_layers", "list"): "[1], the fixture's own value",
    ("norm_topk_prob", "true"): "true, the fixture's own value",
    ("norm_topk_prob", "delete"): "transformers' default false: the top-k weights not renormalised",
    ("attention_k_eq_v", "true"): "true, the fixture's own value",
    ("use_double_wide_mlp", "true"): "true, the fixture's own value",
    ("final_logit_softcapping", "delete"): "absent or null, no soft-capping, as transformers",
    ("final_logit_softcapping", "null"): "absent or null, no soft-capping, as transformers",
    ("final_logit_softcapping", "float"): "any positive cap is a valid one",
    ("final_logit_softcapping", "huge"): "any positive cap is a valid one",
    ("sliding_window", "delete"): "transformers' default 512, as when it loads the checkpoint",
    ("rope_parameters.full_attention.rope_type", "delete"): "transformers' default RoPE, a valid one",
    ("rope_parameters.full_attention.partial_rotary_factor", "delete"): "1: the whole head rotates",
    ("rope_parameters.full_attention.rope_theta", "float"): "any positive RoPE base is a valid one",
    ("rope_parameters.full_attention.rope_theta", "huge"): "any positive RoPE base is a valid one",
    ("rope_parameters.sliding_attention.rope_theta", "float"): "any positive RoPE base is a valid one",
    ("rope_parameters.sliding_attention.rope_theta", "huge"): "any positive RoPE base is a valid one",
}


# the families' own cases fuzz only the fields a dense Qwen3 config.json does not have, and these
# that they read differently
FAMILIES = ("hybrid", "moe", "gemma4")
FAMILY_KEYS = {"model_type", "architectures", "layer_types", "head_dim", "num_key_value_heads",
               "intermediate_size", "tie_word_embeddings", "hidden_act"}


def fields(config: dict, prefix: tuple = ()):
    """Paths to every field of ``config``, nested objects and objects in lists included."""
    for key, value in config.items():
        yield (*prefix, key)
        if isinstance(value, dict):
            yield from fields(value, (*prefix, key))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, dict):
                    yield from fields(item, (*prefix, key, index))


def mutated(config: dict, path: tuple, value) -> dict:
    config = json.loads(json.dumps(config))
    parent = config
    for key in path[:-1]:
        parent = parent[key]
    if value is DELETE:
        parent.pop(path[-1])
    else:
        parent[path[-1]] = value
    return config


def linked_pair(source: tuple[Path, Path], root: Path) -> tuple[Path, Path]:
    """The pair with every file but config.json a symbolic link to the fixture's."""
    copies = []
    for directory in source:
        copy = root / directory.name
        copy.mkdir()
        for file in directory.iterdir():
            if file.name != "config.json":
                (copy / file.name).symlink_to(file)
        copies.append(copy)
    return tuple(copies)


def loaded(target: Path, draft: Path):
    target_step, draft_step = load_pair(target, draft)
    return asdict(target_step.config), asdict(draft_step.config), draft_step.k


def name(path: tuple) -> str:
    return ".".join(map(str, path))


def verdict(path: tuple, mutation: str, outcome, baseline) -> str | None:
    """None when the outcome is as it should be, else what is wrong."""
    field = name(path)
    key = field.removeprefix("transformer_layer_config.").removeprefix("text_config.")
    if isinstance(outcome, tuple):  # loaded
        if outcome == baseline:
            unused = key in UNUSED or key.startswith(UNUSED_SECTIONS) or (key, mutation) in VALID
            return None if unused else "loaded, unlisted in UNUSED"
        return None if (key, mutation) in VALID else "loaded with a changed configuration, unlisted in VALID"
    return outcome


@pytest.mark.slow
@pytest.mark.parametrize("case", ["target", "native", "speculators", "hybrid", "moe", "gemma4"])
def test_every_config_field_loads_or_is_refused_in_one_line(tiny, tmp_path, case):
    """``hybrid``: a Qwen3.5 target in its ForConditionalGeneration layout (text_config nested,
    the linear-attention fields, a vision_config); ``moe``: a Qwen3-MoE target; ``gemma4``: a
    Gemma 4 target in its ForConditionalGeneration layout, every feature on (its draft's config,
    a copy of it, is fuzzed once; ``test_gemma4.py`` keeps what that found)."""
    source = {"speculators": lambda: tiny(**SPECULATORS),
              "hybrid": lambda: tiny(arch="qwen3_5-multimodal"),
              "moe": lambda: tiny(arch="qwen3_moe"),
              "gemma4": lambda: tiny(arch="gemma4-multimodal")}.get(case, tiny)()
    target, draft = linked_pair(source, tmp_path)
    for directory, original in zip((target, draft), source):
        (directory / "config.json").write_text((original / "config.json").read_text())
    checkpoint = target if case in ("target", "hybrid", "moe", "gemma4") else draft
    config_file = checkpoint / "config.json"
    original = json.loads(config_file.read_text())
    baseline = loaded(target, draft)

    problems = []
    paths = [*fields(original), *((key,) for key in OPTIONAL[case])]
    if case in FAMILIES:   # the dense target's fields are fuzzed once, in the "target" case
        dense = {name(path) for path in fields(json.loads((tiny()[0] / "config.json").read_text()))}
        paths = [path for path in paths if name(path).removeprefix("text_config.") not in dense - FAMILY_KEYS]
    for path in paths:
        for mutation, value in MUTATIONS.items():
            if mutation == "delete" and path[-1] in OPTIONAL[case]:
                continue
            config_file.write_text(json.dumps(mutated(original, path, value)))
            try:
                outcome = loaded(target, draft)
            except ValueError as err:  # CheckpointError included
                # a tensor that does not match names the folder, "expected from config.json"
                message = str(err)
                named = str(checkpoint) in message and "config.json" in message
                one_line = named and "\n" not in message
                outcome = None if one_line else f"not one line naming config.json: {message}"
            except Exception as err:  # the point: no other exception type
                outcome = f"{type(err).__name__}: {err}"
            problem = verdict(path, mutation, outcome, baseline)
            if problem:
                problems.append(f"{name(path)} {mutation}: {problem[:300]}")
    assert not problems, f"{len(problems)} mutations misbehave:\n" + "\n".join(problems)
