"""The family registry (``modeling/registry.py``): every architecture it lists has a config that is
read alike whichever ``transformers`` saved it (the version we pin, and DeepSpec's 5.10.2, whose
configs sit in ``tests/data/configs``; see ``family_configs.py``), and the manifest schema lists
the same architectures."""
import json
from pathlib import Path

import pytest

from common import manifest
from modeling.registry import ARCHITECTURES, DRAFTS
from modeling.target_config_reader import load_target_config

from family_configs import configs, save_configs

OLD = Path(__file__).parents[1] / "data" / "configs" / "transformers-5.10.2"


@pytest.fixture(scope="module")
def saved_now(tmp_path_factory):
    out = tmp_path_factory.mktemp("configs")
    save_configs(out)
    return out


def test_every_architecture_is_covered():
    assert {name.split("-")[0] for name in configs()} == set(ARCHITECTURES)
    assert {path.name for path in OLD.iterdir()} == set(configs())
    schema = json.loads(manifest.SCHEMA.read_text())
    assert schema["properties"]["target"]["properties"]["architecture"]["enum"] == list(ARCHITECTURES)
    assert schema["properties"]["draft"]["properties"]["architecture"]["enum"] == list(DRAFTS)
    assert {a.family.draft for a in ARCHITECTURES.values()} <= set(DRAFTS)


@pytest.mark.parametrize("name", list(configs()))
def test_a_config_saved_by_either_version_reads_alike(saved_now, name):
    old, now = load_target_config(OLD / name), load_target_config(saved_now / name)
    assert old == now and old.architecture == name.split("-")[0]
    assert (old.moe is not None) == ("Moe" in name or name.endswith("-moe"))
    if old.gemma4 is not None:
        # 5.10.2 writes num_global_key_value_heads null unless the full layers share k and v
        expected = 1 if old.gemma4.attention_k_eq_v else old.decoder.num_kv_heads
        assert (old.gemma4.full_kv_heads, old.gemma4.full_head_dim) == (expected, 32)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_moe-multimodal"])
def test_the_tiny_tokenizer_reads_alike_in_every_family(tiny, arch):
    """transformers 5.24 loads a Qwen3.5 checkpoint's tokenizer as ``Qwen3_5Tokenizer`` (byte-level
    BPE) whatever its tokenizer.json says; the tiny one still gives one id per character there,
    spaces and newlines too, as in every other family and in 5.10.2."""
    from transformers import AutoTokenizer

    from modeling.fixtures.tiny import CHARACTERS, SPECIALS

    text = "the cat sat\nOn 3+4=7? \"yes\""
    tokenizer = AutoTokenizer.from_pretrained(tiny(arch=arch)[0])
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids == [len(SPECIALS) + CHARACTERS.index(c) for c in text]
    assert tokenizer.decode(ids) == text
