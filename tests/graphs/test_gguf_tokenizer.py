"""A GGUF target's tokenizer: the release-shaped presets' (a byte-level BPE with merges) is read back
from a GGUF file as it was written, and a file whose tokenizer no reader can rebuild is refused in
one line that names the file and the field, before any model loads."""
import importlib.util
import json

import pytest

import export.__main__ as cli
from export.build import _save_tokenizer
from modeling.fixtures.presets import MERGES
from modeling.fixtures.tiny import _tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf extra")
TEXT = "the tin rain on a hat, 42 in there"


def _write_gguf(path, config: dict, tokenizer, merges: bool = True, vocabulary: bool = True):
    """A Qwen3 GGUF file's header (no tensors) with ``tokenizer``'s vocabulary as llama.cpp's
    converter writes a BPE one: tokens by id, their types, the merges."""
    import gguf

    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if vocabulary:
        model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(sorted(model["vocab"], key=model["vocab"].get))
        writer.add_token_types([gguf.TokenType.NORMAL] * len(model["vocab"]))
        if merges:
            writer.add_token_merges([" ".join(pair) for pair in model["merges"]])
        writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_presets_tokenizer_comes_back_from_a_gguf_file(tiny, tmp_path):
    target, _ = tiny()
    written = _tokenizer(MERGES)
    path = _write_gguf(tmp_path / "model.gguf", json.loads((target / "config.json").read_text()), written)
    read = _save_tokenizer(path, tmp_path / "tokenizer")
    assert read.encode(TEXT) == written.encode(TEXT)
    assert len(written.encode(TEXT)) < len(TEXT)   # the merges apply: fewer tokens than characters
    assert read.decode(read.encode(TEXT)) == TEXT


@pytest.mark.parametrize("case, message", [
    ("no merges", r"model\.gguf: its BPE tokenizer \(tokenizer\.ggml\.model gpt2\) has no "
                  r"tokenizer\.ggml\.merges \(nor tokenizer\.ggml\.scores to derive them from\)"),
    ("no tokenizer", r"model\.gguf: no tokenizer\.ggml\.model field"),
])
def test_a_gguf_tokenizer_no_reader_can_rebuild_is_one_line(tiny, tmp_path, capsys, case, message):
    target, draft = tiny()
    path = _write_gguf(tmp_path / "model.gguf", json.loads((target / "config.json").read_text()),
                       _tokenizer(MERGES), merges=case != "no merges", vocabulary=case != "no tokenizer")
    with pytest.raises(SystemExit, match=message):
        cli.main(["build", "--target", str(path), "--draft", str(draft), "--out", str(tmp_path / "e"),
                  "--max-seq-len", "64", "--quiet"])
    assert not (tmp_path / "e").exists()
    assert "Traceback" not in capsys.readouterr().err
