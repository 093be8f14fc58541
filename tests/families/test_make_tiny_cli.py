"""``python -m export make-tiny``, and that every command-line entry point starts."""
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import export.__main__ as export_cli
from modeling.fixtures.tiny import TinySpec, make_tiny
from modeling.pair import load_pair

ROOT = Path(__file__).resolve().parents[2]


def test_make_tiny_writes_loadable_pair(tmp_path):
    out = tmp_path / "pair"
    export_cli.main(["make-tiny", str(out), "--arch", "llama", "--draft-format", "speculators",
                     "--draft-vocab", "30", "--layout", "bonus-anchor"])
    config = json.loads((out / "draft" / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["sample_from_anchor"] is False
    target, draft = load_pair(out / "target", out / "draft")
    assert target.config.architecture == "LlamaForCausalLM"
    assert draft.config.draft_vocab_size == 30 and draft.k == 3
    assert (out / "target" / "tokenizer.json").is_file()
    draft_files = out / "draft"
    assert (draft_files / "model.safetensors").stat().st_mode == (draft_files / "config.json").stat().st_mode


def test_make_tiny_refuses_a_non_empty_out_without_force(tmp_path):
    (tmp_path / "keep.txt").write_text("user data")
    with pytest.raises(SystemExit, match="not empty; pass --force"):
        export_cli.main(["make-tiny", str(tmp_path)])
    assert (tmp_path / "keep.txt").read_text() == "user data"
    export_cli.main(["make-tiny", str(tmp_path), "--force"])
    assert not (tmp_path / "keep.txt").exists()


def test_make_tiny_rejects_a_bad_draft_vocab(tmp_path):
    with pytest.raises(SystemExit, match="--draft-vocab 1000"):
        export_cli.main(["make-tiny", str(tmp_path / "x"), "--draft-vocab", "1000"])


def test_module_entry_points_run():
    for module in ("export", "runtime.generate", "bench"):
        result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT,
                                capture_output=True, text=True, check=True)
        assert "usage: python -m" in result.stdout


@pytest.mark.parametrize("size", ["0", "1", "-3", "5000"])
def test_make_tiny_refuses_a_block_size_the_draft_cannot_use(tmp_path, size):
    out = tmp_path / "pair"
    with pytest.raises(SystemExit, match=rf"--block-size {size}: expected an integer from 2 to 1024") as info:
        export_cli.main(["make-tiny", str(out), "--block-size", size, "--layout", "bonus-anchor"])
    assert "\n" not in str(info.value)
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_tiny_spec_is_checked_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="--draft-vocab 3: expected"):
        make_tiny(tmp_path, TinySpec(draft_vocab=3))
    assert not any(tmp_path.iterdir())


def test_make_tiny_files_follow_the_umask(tmp_path):
    """safetensors' save_file (under transformers' save_pretrained) makes the weights readable by
    their owner only; every file of the pair is created as the user's umask says."""
    previous = os.umask(0o022)
    try:
        make_tiny(tmp_path, TinySpec())
    finally:
        os.umask(previous)
    for file in (tmp_path / "target").iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o644, file.name
    for file in (tmp_path / "draft").iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o644, file.name
