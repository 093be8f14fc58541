"""Loading target and draft checkpoints (``docs/dspark.md#checkpoint-and-config-conventions``):
the supported layouts load with the right configuration and tensors, and every unusable checkpoint
is refused with a ``CheckpointError`` that names the file and the field or tensor at fault.

Each bad case is a tiny checkpoint from the session fixture, copied into ``tmp_path`` and edited.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modeling.checkpoint import CheckpointError
from modeling.draft import load_draft
from modeling.draft_config import ANCHOR_FIRST, BONUS_ANCHOR, load_draft_config, resolve_k
from modeling.fixtures.tiny import CHARACTERS, SPECIALS
from modeling.pair import load_pair
from modeling.target import every_row, load_target

VOCAB = len(SPECIALS) + len(CHARACTERS)
LAYERS, HIDDEN = 4, 64
SPECULATORS = dict(draft_format="speculators", layout=BONUS_ANCHOR)
REDUCED = dict(draft_vocab=40)


# --- helpers -----------------------------------------------------------------------------------

def copy_pair(tiny, tmp_path: Path, **spec) -> tuple[Path, Path]:
    """A private, editable copy of the fixture's ``(target_dir, draft_dir)``."""
    target, draft = tiny(**spec)
    return (Path(shutil.copytree(target, tmp_path / "target")),
            Path(shutil.copytree(draft, tmp_path / "draft")))


def edit_config(directory: Path, change) -> None:
    """``change(config)`` mutates the parsed config.json in place."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config, indent=2))


def edit_tensors(directory: Path, change) -> None:
    """``change(tensors)`` mutates the dict of model.safetensors in place."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def update(**fields):
    return lambda config: config.update(fields)


def drop(*keys):
    return lambda mapping: [mapping.pop(key) for key in keys]


def load_draft_for(target_dir: Path, draft_dir: Path, **kwargs):
    return load_draft(draft_dir, load_target(target_dir), **kwargs)


def refused(load, where: Path, match: str) -> CheckpointError:
    """``load()`` raises a CheckpointError matching ``match`` whose message names ``where``."""
    with pytest.raises(CheckpointError, match=match) as info:
        load()
    assert str(where) in str(info.value)
    return info.value


def run_target(target, ids: list[int]):
    batch = torch.tensor([ids])
    start = torch.zeros(1, dtype=torch.long)
    return target(batch, start, every_row(batch), *target.empty_cache(1, 16))


# --- targets -----------------------------------------------------------------------------------

def test_qwen3_target_is_untied_with_its_own_lm_head(tiny):
    target_dir, _ = tiny()
    target = load_target(target_dir)
    c = target.config
    assert c.architecture == "Qwen3ForCausalLM"
    assert (c.vocab_size, c.decoder.num_layers, c.decoder.hidden_size) == (VOCAB, LAYERS, HIDDEN)
    assert not c.tie_word_embeddings and c.decoder.qk_norm
    assert c.eos_token_ids == (1,)
    file = load_file(target_dir / "model.safetensors")
    assert torch.equal(target.lm_head.weight, file["lm_head.weight"])
    assert not torch.equal(target.lm_head.weight, target.embed_tokens.weight)


def test_llama_target_ties_lm_head_to_embeddings(tiny):
    target_dir, _ = tiny(arch="llama")
    assert "lm_head.weight" not in load_file(target_dir / "model.safetensors")
    target = load_target(target_dir)
    assert target.config.architecture == "LlamaForCausalLM"
    assert target.config.tie_word_embeddings and not target.config.decoder.qk_norm
    assert target.lm_head.weight is target.embed_tokens.weight   # one tensor: one ONNX initializer


def test_eos_ids_come_from_generation_config(tiny, tmp_path):
    target_dir = Path(shutil.copytree(tiny()[0], tmp_path / "target"))
    path = target_dir / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"eos_token_id": [1, 4]}))
    assert load_target(target_dir).config.eos_token_ids == (1, 4)


def test_sharded_target_matches_the_single_file(tiny, tmp_path):
    single = tiny()[0]
    sharded = Path(shutil.copytree(single, tmp_path / "target"))
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, sharded / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))

    ids = [5, 17, 9, 30, 2, 11]
    expected, *_ = run_target(load_target(single, taps=(0, 2)), ids)
    logits, aux, *_ = run_target(load_target(sharded, taps=(0, 2)), ids)
    assert logits.shape == (1, len(ids), VOCAB) and aux.shape == (1, len(ids), 2 * HIDDEN)
    assert torch.equal(logits, expected)


def test_hub_id_offline_is_a_checkpoint_error_naming_the_flag(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import; make the setting take effect here too
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match=r"--target acme/no-such-dspark-target"):
        load_target("acme/no-such-dspark-target")


def test_missing_local_path_is_a_checkpoint_error():
    with pytest.raises(CheckpointError, match=r"--target \./does-not-exist.*no such folder"):
        load_target("./does-not-exist")


# --- drafts ------------------------------------------------------------------------------------

def test_native_draft_config_is_translated(tiny):
    target, draft = load_pair(*tiny())
    c = draft.config
    assert c.source_format == "native" and c.layout == ANCHOR_FIRST
    assert (c.block_size, c.mask_token_id, c.markov_rank) == (4, SPECIALS.index("<mask>"), 8)
    assert c.target_layer_ids == (0, 2) and c.target_hidden_size == HIDDEN
    assert (c.vocab_size, c.draft_vocab_size, c.default_k) == (VOCAB, VOCAB, None)
    assert draft.k == 4


def test_native_draft_shares_embeddings_and_lm_head_with_target(tiny):
    target_dir, draft_dir = tiny()
    assert not {"embed_tokens.weight", "lm_head.weight"} & load_file(draft_dir / "model.safetensors").keys()
    target, draft = load_pair(target_dir, draft_dir)
    assert torch.equal(draft.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)


def test_confidence_head_is_ignored_even_when_malformed(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path)
    edit_tensors(draft_dir, lambda t: t.update({"confidence_head.proj.weight": torch.zeros(3, 5)}))
    draft = load_draft_for(target_dir, draft_dir)
    assert not any(name.startswith("confidence_head") for name in draft.state_dict())


def test_native_bonus_anchor_flag(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path)
    edit_config(draft_dir, update(dspark_bonus_anchor=True))
    draft = load_draft_for(target_dir, draft_dir)
    assert draft.config.layout == BONUS_ANCHOR and draft.k == 3


@pytest.mark.parametrize("sections", [["dflash_config"], ["eagle_config"], ["eagle_config", "dflash_config"]])
def test_native_nested_taps_and_mask_are_read_where_vllm_reads_them(tiny, tmp_path, sections):
    """dflash_config, then eagle_config, then the top level; the last section listed holds the true
    values, everything before it decoys."""
    target_dir, draft_dir = copy_pair(tiny, tmp_path)
    mask = SPECIALS.index("<mask>")

    def nest(config):
        config.update(target_layer_ids=[0, 1], mask_token_id=0)
        for section in sections[:-1]:
            config[section] = {"target_layer_ids": [1, 2], "mask_token_id": 1}
        config[sections[-1]] = {"target_layer_ids": [0, 2], "mask_token_id": mask, "causal": False}

    edit_config(draft_dir, nest)
    config = load_draft_for(target_dir, draft_dir).config
    assert (config.target_layer_ids, config.mask_token_id) == ((0, 2), mask)


def test_nested_tap_outside_the_target_names_its_section(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path)
    edit_config(draft_dir, update(dflash_config={"target_layer_ids": [0, 7]}))
    refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir / "config.json",
            r"'dflash_config.target_layer_ids' names layer 7\b")


@pytest.mark.parametrize("ids, loads", [([1, 3], True), ([0, 2], False), ([1, 2, 3], False)])
def test_native_capture_ids_must_be_the_taps_plus_one(tiny, tmp_path, ids, loads):
    target_dir, draft_dir = copy_pair(tiny, tmp_path)
    edit_config(draft_dir, update(eagle_aux_hidden_state_layer_ids=ids))
    if loads:
        assert load_draft_for(target_dir, draft_dir).config.target_layer_ids == (0, 2)
    else:
        refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir / "config.json",
                r"'eagle_aux_hidden_state_layer_ids' = .*expected \[1, 3\]")


@pytest.mark.parametrize("spec", [{}, SPECULATORS], ids=["native", "speculators"])
def test_logit_scale_multiplies_the_logits_and_the_markov_bias(tiny, tmp_path, spec):
    target_dir, draft_dir = copy_pair(tiny, tmp_path, **spec)
    target = load_target(target_dir)
    plain = load_draft(draft_dir, target)
    key = "transformer_layer_config" if spec else None
    edit_config(draft_dir, lambda c: (c[key] if key else c).update(logit_scale=0.75))
    scaled = load_draft(draft_dir, target)
    torch.manual_seed(0)
    aux = torch.randn(12, plain.config.target_hidden_size * len(plain.config.target_layer_ids))
    tokens, anchors = torch.randint(VOCAB, (12,)), torch.tensor([2, 5, 9])
    with torch.no_grad():
        expected = 0.75 * plain.training_logits(aux, tokens, anchors)
        torch.testing.assert_close(scaled.training_logits(aux, tokens, anchors), expected)
    # the target's lm_head, which a native draft shares, is left as it was
    assert torch.equal(target.lm_head.weight, load_target(target_dir).lm_head.weight)


@pytest.mark.parametrize("value", [0, -1.0, "2", True])
def test_logit_scale_of_the_wrong_type_or_range_is_named(tiny, tmp_path, value):
    target_dir, draft_dir = copy_pair(tiny, tmp_path)
    edit_config(draft_dir, update(logit_scale=value))
    err = refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir / "config.json",
                  rf"'logit_scale' = {value!r}")
    one_line_naming(err, "expected a number > 0")


def test_speculators_draft_config_is_translated(tiny):
    target_dir, draft_dir = tiny(**SPECULATORS)
    raw = json.loads((draft_dir / "config.json").read_text())
    assert raw["aux_hidden_state_layer_ids"] == [1, 3] and raw["sample_from_anchor"] is False
    target, draft = load_pair(target_dir, draft_dir)
    c = draft.config
    assert c.source_format == "speculators"
    assert c.target_layer_ids == (0, 2)  # vLLM capture ids minus one
    assert c.layout == BONUS_ANCHOR and c.block_size == 4 and c.max_drafts == 3
    assert c.default_k == 3 and draft.k == 3
    # Speculators drafts ship their own embedding; it is loaded, not replaced by the target's
    file = load_file(draft_dir / "model.safetensors")
    assert torch.equal(draft.embed_tokens.weight, file["embed_tokens.weight"])


def test_speculators_speculative_tokens_is_the_default_k(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path, **SPECULATORS)
    edit_config(draft_dir, lambda c: c["speculators_config"]["proposal_methods"][0].update(
        speculative_tokens=2))
    assert load_draft_for(target_dir, draft_dir).k == 2


def test_reduced_vocabulary_loads_d2t_and_ignores_t2d(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path, **REDUCED)
    file = load_file(draft_dir / "model.safetensors")
    assert "t2d" in file
    edit_tensors(draft_dir, lambda t: t.update(t2d=torch.zeros(3, dtype=torch.bool)))  # garbage
    target, draft = load_pair(target_dir, draft_dir)
    assert draft.config.draft_vocab_size == 40 and draft.lm_head.weight.shape == (40, HIDDEN)
    assert torch.equal(draft.d2t, file["d2t"])
    mapped = torch.arange(40) + draft.d2t
    assert mapped.min() >= 0 and mapped.max() < VOCAB
    assert mapped.unique().numel() == 40
    assert "t2d" not in draft.state_dict()


# --- resolve_k ---------------------------------------------------------------------------------

def _native_config(draft_dir: Path):
    return load_draft_config(draft_dir, LAYERS, HIDDEN)


def test_resolve_k_defaults_to_max_drafts(tiny, tmp_path):
    _, draft_dir = copy_pair(tiny, tmp_path)
    assert resolve_k(_native_config(draft_dir), None) == 4  # anchor-first: block_size
    edit_config(draft_dir, update(dspark_bonus_anchor=True))
    assert resolve_k(_native_config(draft_dir), None) == 3  # bonus-anchor: block_size - 1


def test_smaller_k_is_accepted(tiny):
    target_dir, draft_dir = tiny()
    assert load_draft_for(target_dir, draft_dir, k=2).k == 2


@pytest.mark.parametrize("k", [5, 0])
def test_k_outside_the_block_is_refused(tiny, k):
    target_dir, draft_dir = tiny()
    with pytest.raises(ValueError, match=rf"--k {k}\b"):
        load_draft_for(target_dir, draft_dir, k=k)


# --- refusals: targets -------------------------------------------------------------------------

def test_unsupported_target_architecture(tiny, tmp_path):
    target_dir, _ = copy_pair(tiny, tmp_path)
    edit_config(target_dir, update(architectures=["MistralForCausalLM"]))
    refused(lambda: load_target(target_dir), target_dir / "config.json",
            r"MistralForCausalLM.*Qwen3ForCausalLM, LlamaForCausalLM")


def test_target_without_config_json(tiny, tmp_path):
    target_dir, _ = copy_pair(tiny, tmp_path)
    (target_dir / "config.json").unlink()
    refused(lambda: load_target(target_dir), target_dir / "config.json", r"config\.json: missing")


def test_target_without_safetensors(tiny, tmp_path):
    target_dir, _ = copy_pair(tiny, tmp_path)
    (target_dir / "model.safetensors").unlink()
    refused(lambda: load_target(target_dir), target_dir, r"no \*\.safetensors")


# --- refusals: draft config --------------------------------------------------------------------

def test_draft_of_unknown_kind(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path)
    edit_config(draft_dir, update(architectures=["Qwen3ForCausalLM"]))
    refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir / "config.json",
            r"Qwen3DSparkModel.*speculators_model_type")


def test_gated_markov_head(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path)
    edit_config(draft_dir, update(markov_head_type="gated"))
    refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir / "config.json",
            r"markov_head_type 'gated'")


def test_markov_rank_zero(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path)
    edit_config(draft_dir, update(markov_rank=0))
    refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir / "config.json",
            r"markov_rank 0\b")


@pytest.mark.parametrize("taps, layer", [([0, 7], 7), ([0, 3], 3), ([-2, 0], -2)])
def test_native_tap_outside_the_target(tiny, tmp_path, taps, layer):
    """Layer 3 exists but is the final layer, whose output HF only exposes normed."""
    target_dir, draft_dir = copy_pair(tiny, tmp_path)
    edit_config(draft_dir, update(target_layer_ids=taps))
    refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir / "config.json",
            rf"'target_layer_ids' names layer {layer}\b.*{LAYERS} layers")


@pytest.mark.parametrize("ids, layer", [([1, 9], 9), ([1, 4], 4)])
def test_speculators_aux_id_outside_the_target(tiny, tmp_path, ids, layer):
    target_dir, draft_dir = copy_pair(tiny, tmp_path, **SPECULATORS)
    edit_config(draft_dir, update(aux_hidden_state_layer_ids=ids))
    refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir / "config.json",
            rf"'aux_hidden_state_layer_ids' names layer {layer}\b")


def test_fc_width_must_match_taps_times_target_hidden(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path)
    edit_config(draft_dir, update(target_layer_ids=[0, 1, 2]))  # fc still has 2 x 64 columns
    refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir,
            rf"fc\.weight has input width \[{2 * HIDDEN}\].*3 taps.*{3 * HIDDEN}")


def test_larger_draft_vocab_needs_embed_tokens(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path)
    edit_config(draft_dir, update(vocab_size=VOCAB + 8))
    edit_tensors(draft_dir, lambda t: t.update(
        {"markov_head.markov_w1.weight": torch.randn(VOCAB + 8, 8)}))
    refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir / "config.json",
            rf"vocab_size {VOCAB + 8}\b.*embed_tokens\.weight")


def test_speculators_without_transformer_layer_config(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path, **SPECULATORS)
    edit_config(draft_dir, drop("transformer_layer_config"))
    refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir / "config.json",
            r"transformer_layer_config or transformer_config")


def test_speculators_without_proposal_methods(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path, **SPECULATORS)
    edit_config(draft_dir, lambda c: c["speculators_config"].pop("proposal_methods"))
    refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir / "config.json",
            r"speculators_config\.proposal_methods")


def test_speculators_model_type_other_than_dspark(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path, **SPECULATORS)
    edit_config(draft_dir, update(speculators_model_type="eagle3"))
    refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir / "config.json",
            r"speculators_model_type 'eagle3'")


# --- refusals: draft tensors -------------------------------------------------------------------

def test_reduced_vocab_without_lm_head(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path, **REDUCED)
    edit_tensors(draft_dir, drop("lm_head.weight"))
    refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir,
            r"draft_vocab_size 40\b.*lm_head\.weight")


def test_reduced_vocab_without_d2t(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path, **REDUCED)
    edit_tensors(draft_dir, drop("d2t"))
    refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir,
            r"draft_vocab_size 40\b.*\bd2t\b")


def test_d2t_mapping_outside_the_target_vocab(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path, **REDUCED)

    def out_of_range(tensors):
        tensors["d2t"][-1] = VOCAB  # draft id 39 -> 39 + VOCAB

    edit_tensors(draft_dir, out_of_range)
    refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir,
            rf"\bd2t\b.*outside the target vocabulary \[0, {VOCAB}\)")


def test_tensor_with_wrong_shape(tiny, tmp_path):
    target_dir, draft_dir = copy_pair(tiny, tmp_path)
    edit_tensors(draft_dir, lambda t: t.update({"norm.weight": t["norm.weight"][:32].clone()}))
    refused(lambda: load_draft_for(target_dir, draft_dir), draft_dir,
            rf"tensor norm\.weight has shape \[32\], expected \[{HIDDEN}\]")


def test_target_hidden_size_must_match_the_target(tiny, tmp_path):
    target, draft = copy_pair(tiny, tmp_path, **SPECULATORS)
    edit_config(draft, update(target_hidden_size=2 * HIDDEN))
    edit_tensors(draft, lambda t: t.update({"fc.weight": torch.zeros(HIDDEN, 4 * HIDDEN)}))
    refused(lambda: load_draft_for(target, draft), draft, r"target_hidden_size 128 .* hidden_size 64")


def test_mask_token_outside_the_vocabulary(tiny, tmp_path):
    target, draft = copy_pair(tiny, tmp_path)
    edit_config(draft, update(mask_token_id=VOCAB))
    refused(lambda: load_draft_for(target, draft), draft, rf"mask_token_id {VOCAB}")


@pytest.mark.parametrize("tokens", [9, "3"])
def test_speculative_tokens_must_fit_the_block(tiny, tmp_path, tokens):
    target, draft = copy_pair(tiny, tmp_path, **SPECULATORS)
    edit_config(draft, lambda c: c["speculators_config"]["proposal_methods"][0].update(
        speculative_tokens=tokens))
    refused(lambda: load_draft_for(target, draft), draft, "speculative_tokens")


def test_native_taps_must_be_increasing(tiny, tmp_path):
    target, draft = copy_pair(tiny, tmp_path)
    edit_config(draft, update(target_layer_ids=[2, 0]))
    refused(lambda: load_draft_for(target, draft), draft, r"target_layer_ids.*increasing")


# --- refusals: config fields that fix shapes, and unreadable weights ---------------------------

def one_line_naming(err: Exception, *words: str) -> str:
    message = str(err)
    assert "\n" not in message and all(word in message for word in words), message
    return message


def backbone(config: dict) -> dict:
    """The part of a draft config that describes its decoder (the whole of a native config)."""
    return config.get("transformer_layer_config", config)


@pytest.mark.parametrize("spec", [{}, SPECULATORS], ids=["native", "speculators"])
@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"])
def test_draft_missing_shape_field_is_named(tiny, tmp_path, spec, field):
    """transformers fills a missing field with its class default (Qwen3: hidden_size 4096), which
    says nothing about this checkpoint: the field is named as missing."""
    target, draft = copy_pair(tiny, tmp_path, **spec)
    edit_config(draft, lambda c: backbone(c).pop(field))
    err = refused(lambda: load_pair(target, draft), draft / "config.json", rf"missing field '{field}'")
    assert "4096" not in str(err) and "differs" not in str(err)


@pytest.mark.parametrize("spec", [{}, SPECULATORS], ids=["native", "speculators"])
@pytest.mark.parametrize("field, value", [("num_hidden_layers", "1"), ("hidden_size", "64"),
                                          ("head_dim", True), ("intermediate_size", 128.0),
                                          ("num_attention_heads", -4), ("num_key_value_heads", 0),
                                          ("vocab_size", 10 ** 12)])
def test_draft_backbone_field_of_the_wrong_type_or_range_is_named(tiny, tmp_path, spec, field, value):
    target, draft = copy_pair(tiny, tmp_path, **spec)
    edit_config(draft, lambda c: backbone(c).update({field: value}))
    err = refused(lambda: load_pair(target, draft), draft / "config.json", rf"'{field}' = {value!r}")
    one_line_naming(err, "expected an integer")


@pytest.mark.parametrize("field, value", [("hidden_size", "64"), ("num_hidden_layers", None),
                                          ("max_position_embeddings", 0), ("use_cache", "yes")])
def test_target_field_of_the_wrong_type_or_range_is_named(tiny, tmp_path, field, value):
    target, draft = copy_pair(tiny, tmp_path)
    edit_config(target, update(**{field: value}))
    err = refused(lambda: load_pair(target, draft), target / "config.json", field)
    one_line_naming(err)


@pytest.mark.parametrize("arch", ["qwen3", "gemma4-multimodal"])
def test_kv_heads_that_do_not_divide_the_heads_are_named(tiny, tmp_path, arch):
    """4 query heads over 3 KV heads: attention would fail deep in a build (a Qwen3 of width 3840
    with 30 heads over 8 did)."""
    target, draft = copy_pair(tiny, tmp_path, arch=arch)
    edit_config(target, lambda c: c.get("text_config", c).update(num_key_value_heads=3))
    err = refused(lambda: load_pair(target, draft), target / "config.json", "field 'num_key_value_heads' = 3")
    one_line_naming(err, "expected a divisor of num_attention_heads (4)")


def test_target_missing_shape_field_is_named(tiny, tmp_path):
    target, draft = copy_pair(tiny, tmp_path)
    edit_config(target, drop("num_hidden_layers"))
    refused(lambda: load_pair(target, draft), target / "config.json", r"missing field 'num_hidden_layers'")


def test_llama_target_derives_head_dim_and_kv_heads_as_transformers_does(tiny, tmp_path):
    """Llama configs may leave out head_dim and num_key_value_heads: transformers derives them
    (hidden_size / heads, and as many KV heads as heads), so a missing one is no error."""
    target, _ = copy_pair(tiny, tmp_path, arch="llama")
    edit_config(target, lambda c: c.pop("head_dim"))
    assert load_target(target).config.decoder.head_dim == HIDDEN // 4


@pytest.mark.parametrize("value", [0, -1.0, True, "1e6", None])
def test_bad_rope_theta_is_named(tiny, tmp_path, value):
    target, draft = copy_pair(tiny, tmp_path)
    edit_config(target, lambda c: c["rope_parameters"].update(rope_theta=value))
    err = refused(lambda: load_pair(target, draft), target / "config.json", "rope_theta")
    one_line_naming(err, "expected a number > 0")


@pytest.mark.parametrize("field, value", [("sample_from_anchor", "no"), ("dspark_bonus_anchor", 1),
                                          ("draft_vocab_size", 0), ("target_hidden_size", "64"),
                                          ("block_size", 10 ** 6)])
def test_draft_dspark_field_of_the_wrong_type_or_range_is_named(tiny, tmp_path, field, value):
    target, draft = copy_pair(tiny, tmp_path)
    edit_config(draft, update(**{field: value}))
    err = refused(lambda: load_pair(target, draft), draft / "config.json", rf"'{field}' = {value!r}")
    one_line_naming(err, "expected")


def test_extra_bias_from_config_names_config_json(tiny, tmp_path):
    target, draft = copy_pair(tiny, tmp_path)
    edit_config(draft, update(attention_bias=True))
    err = refused(lambda: load_pair(target, draft), draft,
                  r"missing tensor\(s\) layers\.0\.self_attn\.q_proj\.bias")
    one_line_naming(err, "config.json")


def truncate(file: Path, keep: int) -> None:
    file.write_bytes(file.read_bytes()[:keep])


@pytest.mark.parametrize("side", ["target", "draft"])
@pytest.mark.parametrize("keep", [4, 100, -100])
def test_truncated_safetensors_is_named(tiny, tmp_path, side, keep):
    target, draft = copy_pair(tiny, tmp_path)
    file = (target if side == "target" else draft) / "model.safetensors"
    truncate(file, keep)
    err = refused(lambda: load_pair(target, draft), file, "not a readable safetensors file")
    one_line_naming(err)


def test_truncated_shard_is_named(tiny, tmp_path):
    target, draft = copy_pair(tiny, tmp_path)
    tensors = load_file(target / "model.safetensors")
    (target / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, target / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    truncate(target / "model-00002-of-00002.safetensors", -10)
    refused(lambda: load_pair(target, draft), target / "model-00002-of-00002.safetensors",
            "not a readable safetensors file")


# --- resolving a name: local folder, cached hub id, download -----------------------------------

@pytest.fixture
def hub(monkeypatch, tmp_path):
    """An empty Hugging Face cache in tmp_path, and a record of every snapshot_download call; a
    download (not local_files_only) fails as it would with no network."""
    import huggingface_hub
    import huggingface_hub.constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = tmp_path / "hub-cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    calls = []
    real = huggingface_hub.snapshot_download

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs.get("local_files_only", False)))
        if kwargs.get("local_files_only"):
            return real(repo_id, **kwargs)
        raise LocalEntryNotFoundError("Got: ConnectError: [Errno -2] Name or service not known\n"
                                      "An error happened while trying to locate the files on the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return cache, calls


def cache_snapshot(cache: Path, repo_id: str, source: Path) -> Path:
    """``source``'s files as the cached snapshot of ``repo_id`` (the layout huggingface_hub reads)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return Path(shutil.copytree(source, repo / "snapshots" / commit))


def test_missing_relative_path_says_neither_folder_nor_cached_hub_id(hub):
    _, calls = hub
    with pytest.raises(CheckpointError) as info:
        load_target("tiny/target")
    one_line_naming(info.value, "--target tiny/target",
                    "neither a local folder nor a hub id in the local cache")
    assert calls[0] == ("tiny/target", True)  # the cache is asked before the network


def test_cached_hub_id_loads_without_the_network(hub, tiny):
    cache, calls = hub
    snapshot = cache_snapshot(cache, "acme/tiny-target", tiny()[0])
    assert load_target("acme/tiny-target").config.vocab_size == VOCAB
    assert calls == [("acme/tiny-target", True)]
    assert snapshot.is_dir()


def test_hub_id_not_cached_is_downloaded(hub, tiny, monkeypatch):
    import huggingface_hub

    _, calls = hub
    local = tiny()[0]
    cached_only = huggingface_hub.snapshot_download

    def download(repo_id, **kwargs):
        return cached_only(repo_id, **kwargs) if kwargs.get("local_files_only") else str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    assert load_target("acme/tiny-target").config.vocab_size == VOCAB
    assert calls == [("acme/tiny-target", True)]


@pytest.mark.parametrize("name", ["./does-not-exist/x", "a/b/c", "not a/hub id", "nothing"])
def test_name_neither_path_nor_hub_id_is_no_such_folder(hub, name):
    _, calls = hub
    with pytest.raises(CheckpointError) as info:
        load_target(name)
    one_line_naming(info.value, f"--target {name}", "no such folder")
    assert calls == []


@pytest.mark.parametrize("side, layers", [("target", 2), ("target", 5000), ("draft", 2)])
def test_layer_count_must_match_the_weights(tiny, tmp_path, side, layers):
    """Fewer layers than the weights hold would silently leave the rest out; many more would take
    minutes to build before any shape is compared."""
    target, draft = copy_pair(tiny, tmp_path)
    checkpoint = target if side == "target" else draft
    edit_config(checkpoint, update(num_hidden_layers=layers, layer_types=["full_attention"] * layers))
    load = (lambda: load_target(target)) if side == "target" else (lambda: load_pair(target, draft))
    err = refused(load, checkpoint / "config.json",
                  rf"'num_hidden_layers' = {layers}, but the weights hold")
    one_line_naming(err)


@pytest.mark.parametrize("content", ['{"eos_token_id": 1000}', '{"eos_token_id": ["1"]}', "{not json"])
def test_bad_generation_config_is_named(tiny, tmp_path, content):
    """An EOS id outside the vocabulary would never end a generation."""
    target, _ = copy_pair(tiny, tmp_path)
    (target / "generation_config.json").write_text(content)
    err = refused(lambda: load_target(target), target / "generation_config.json", "eos_token_id|JSON")
    one_line_naming(err)
