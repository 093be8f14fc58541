"""Qwen3.5 / Qwen3.6 hybrid targets (gated DeltaNet + gated attention), in both on-disk layouts:
greedy speculative == target-only == ``transformers`` ``generate``, token for token, at batch 1
and ragged batch 3, prompts longer than a prefill chunk, with oracle drafts so that every
acceptance count 0..k restores the recurrent state from its slot; and its bad checkpoints."""
import json
import shutil

import pytest
import torch

from export.checkpoint import CheckpointError
from export.pair import load_pair
from runtime.speculative import generate
from runtime.torch_backend import TorchBackend

from conftest import PROMPTS, hf_greedy
from test_greedy_invariant import OracleDrafts

MAX_NEW = 40
CHUNK = 5   # shorter than two of the prompts: the state crosses prefill chunks
ARCHS = ["qwen3_5", "qwen3_5-multimodal"]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculative_equals_target_only_and_transformers(tiny, arch):
    target_dir, draft_dir = tiny(arch=arch)
    target, draft = load_pair(target_dir, draft_dir)
    eos = target.config.eos_token_ids
    expected = hf_greedy(target_dir, PROMPTS, MAX_NEW)
    continuations = hf_greedy(target_dir, PROMPTS, MAX_NEW, eos=None)   # the oracle's truth
    for batch in (1, 3):
        prompts = PROMPTS[:batch]
        oracle = OracleDrafts(target, draft, prompts, continuations, max_prompt_chunk=CHUNK)
        result = generate(oracle, prompts, max_new_tokens=MAX_NEW, eos_token_ids=eos)
        assert result.token_ids == expected[:batch]
        if batch == 3:
            assert {r["accepted"] for r in result.trace if r["step"] > 0} == set(range(draft.k + 1))
        target_only = generate(TorchBackend(target, None, capacity=96, max_prompt_chunk=CHUNK), prompts,
                               max_new_tokens=MAX_NEW, eos_token_ids=eos)
        assert target_only.token_ids == expected[:batch]


def _copy(source, root):
    copy = root / source.name
    shutil.copytree(source, copy)
    return copy


def test_layer_types_that_disagree_with_the_weights_are_named(tiny, tmp_path):
    target_dir, draft_dir = tiny(arch="qwen3_5")
    target = _copy(target_dir, tmp_path)
    config = json.loads((target / "config.json").read_text())
    config["layer_types"] = ["full_attention"] + config["layer_types"][1:]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: field 'layer_types'\[0\] = 'full_attention', "
                                              r"but the weights hold layers.0.linear_attn"):
        load_pair(target, draft_dir)


def test_linear_head_counts_that_disagree_with_the_weights_are_named(tiny, tmp_path):
    target_dir, draft_dir = tiny(arch="qwen3_5")
    target = _copy(target_dir, tmp_path)
    config = json.loads((target / "config.json").read_text())
    config["linear_num_value_heads"] = 2
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="linear_attn.* has shape .* expected .* from config.json"):
        load_pair(target, draft_dir)


def test_a_multimodal_checkpoint_without_text_weights_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    target_dir, draft_dir = tiny(arch="qwen3_5-multimodal")
    target = _copy(target_dir, tmp_path)
    weights = target / "model.safetensors"
    save_file({n: t for n, t in load_file(weights).items() if "language_model" not in n}, weights)
    with pytest.raises(CheckpointError, match=r"no text weights \(model.language_model.\*\)"):
        load_pair(target, draft_dir)


def test_the_vision_tower_and_mtp_layer_are_never_read(tiny, tmp_path, monkeypatch):
    """Only the text model's tensors are read from the file (a 27B release's vision tower and MTP
    layer are GBs)."""
    from safetensors.torch import load_file, save_file
    import export.checkpoint

    target_dir, draft_dir = tiny(arch="qwen3_5-multimodal")
    target = _copy(target_dir, tmp_path)
    weights = target / "model.safetensors"
    save_file({**load_file(weights), "mtp.fc.weight": torch.zeros(2, 2)}, weights)
    read = []
    real = export.checkpoint.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(export.checkpoint, "safe_open", Recording)
    load_pair(target, draft_dir)
    assert read and not [n for n in read if n.startswith(("model.visual.", "mtp."))]
