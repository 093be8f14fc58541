"""``python -m export build`` / ``inspect`` from the command line, and polygraphy on the output."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import export.__main__ as cli
import export.onnx_check
from runtime.ort_backend import OrtBackend

SMALL = ["--max-seq-len", "64", "--max-prompt-chunk", "16", "--max-batch", "2", "--quiet"]


def _build(target, draft, out, *extra):
    cli.main(["build", "--target", str(target), "--draft", str(draft), "--out", str(out), *SMALL, *extra])


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    target, draft = tiny()
    out = tmp_path_factory.mktemp("cli") / "engine"
    _build(target, draft, out, "--k", "3", "--confidence-threshold", "0.25")
    return out


def test_build_writes_the_engine_directory(built, capsys):
    assert {p.name for p in built.iterdir()} == {"manifest.json", "target.onnx", "target.onnx.data",
                                                 "draft.onnx", "draft.onnx.data", "tokenizer"}
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["draft"]["k"] == 3 and manifest["limits"]["max_seq_len"] == 64
    assert manifest["draft"]["confidence_threshold"] == 0.25
    assert OrtBackend(built).limits.confidence_threshold == 0.25     # the runtime's default
    cli.main(["inspect", str(built)])
    text = capsys.readouterr().out
    assert "k = 3 drafts per step (cut at confidence < 0.25)" in text and "KV capacity 64" in text
    assert "draft parts: fc float32, hidden_norm float32, rest float32" in text
    assert "D2T" not in text
    # the caches of every layer in one line per graph and direction, not one line each
    layers = manifest["target"]["decoder"]["num_layers"]
    assert f"k_cache_0 .. v_cache_{layers - 1}: {2 * layers} caches" in text
    assert sum("cache" in line for line in text.splitlines()) == 4


def test_build_summary_lists_files(tiny, tmp_path, capsys):
    target, draft = tiny()
    _build(target, draft, tmp_path / "e")
    out = capsys.readouterr().out
    assert "target.onnx" in out and "draft.onnx" in out and "ONNX Runtime vs PyTorch" in out
    # the tiny draft's config says block_size 4 (anchor-first); no weight could contradict it
    assert "k = 4 drafts per step (from the draft's config.json: block_size 4, anchor-first)" in out


def test_non_empty_out_needs_force(built, tiny):
    target, draft = tiny()
    before = (built / "manifest.json").read_text()
    with pytest.raises(SystemExit, match="not empty; pass --force"):
        _build(target, draft, built)
    assert (built / "manifest.json").read_text() == before


@pytest.mark.parametrize("flag, value, message", [
    ("--k", "9", "--k 9"),
    ("--max-prompt-chunk", "128", "--max-prompt-chunk 128"),
    ("--max-seq-len", "4096", "--max-seq-len 4096"),
    ("--confidence-threshold", "1.5", "--confidence-threshold 1.5"),
])
def test_bad_flags_are_named(tiny, tmp_path, flag, value, message):
    target, draft = tiny()
    args = ["build", "--target", str(target), "--draft", str(draft), "--out", str(tmp_path / "e"),
            *SMALL, flag, value]
    with pytest.raises(SystemExit, match=message):
        cli.main(args)
    assert not (tmp_path / "e").exists()  # nothing half-built is left behind


def test_target_and_draft_come_together_or_not_at_all(tiny, tmp_path):
    target, _ = tiny()
    with pytest.raises(SystemExit, match="pass both --target and --draft, or neither for the built-in demo"):
        cli.main(["build", "--target", str(target), "--out", str(tmp_path / "e")])
    assert not (tmp_path / "e").exists()


def test_missing_checkpoint_and_unsupported_architecture(tiny, tmp_path):
    target, draft = tiny()
    with pytest.raises(SystemExit, match="--draft .*missing"):
        _build(target, tmp_path / "missing", tmp_path / "e1")
    bad = Path(shutil.copytree(target, tmp_path / "mistral"))
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(SystemExit, match="MistralForCausalLM.*Qwen3ForCausalLM"):
        _build(bad, draft, tmp_path / "e2")


def test_verification_failure_names_the_graph(tiny, tmp_path, monkeypatch):
    target, draft = tiny()
    monkeypatch.setitem(export.onnx_check.TOLERANCE, "float32", 0.0)
    failure = r"draft\.onnx: output .\w+. differs .* by"  # the draft is built and verified first
    with pytest.raises(SystemExit, match=failure):
        _build(target, draft, tmp_path / "e")


def test_inspect_refuses_a_directory_without_manifest(tiny, tmp_path):
    with pytest.raises(SystemExit, match="manifest.json: missing"):
        cli.main(["inspect", str(tmp_path)])
    with pytest.raises(SystemExit, match=f"error: {tmp_path / 'nowhere'}: no such engine directory$"):
        cli.main(["inspect", str(tmp_path / "nowhere")])
    target, _ = tiny()
    with pytest.raises(SystemExit, match="a model checkpoint .config.json., not an engine directory; "
                                         "build an engine from checkpoints with .* --out engines/NAME"):
        cli.main(["inspect", str(target)])
    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(SystemExit, match="schema_version 99 is newer"):
        cli.main(["inspect", str(tmp_path)])


def test_polygraphy_inspects_and_runs_the_graphs(built):
    script = Path(sys.executable).parent / "polygraphy"
    if not script.is_file():
        pytest.skip("polygraphy is not installed")
    polygraphy = [sys.executable, str(script)]
    shown = subprocess.run([*polygraphy, "inspect", "model", str(built / "draft.onnx")],
                           capture_output=True, text=True, check=True).stdout
    assert "Other Opsets: {'dspark': 1}" in shown and "tokens" in shown
    run = subprocess.run([*polygraphy, "run", str(built / "target.onnx"), "--onnxrt",
                          "--input-shapes", "input_ids:[2,5]", "start:[2]", "logit_rows:[2,1]",
                          *[f"{kind}_cache_{layer}:[2,2,64,16]" for layer in range(4) for kind in "kv"],
                          "--val-range", "input_ids:[0,80]", "start:[0,50]", "logit_rows:[0,4]"],
                         capture_output=True, text=True)
    assert run.returncode == 0 and "PASSED" in run.stdout + run.stderr


def test_max_seq_len_defaults_to_what_the_target_supports(tiny, tmp_path):
    target, draft = tiny()
    short = Path(shutil.copytree(target, tmp_path / "short"))
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 96}))
    args = ["build", "--target", str(short), "--draft", str(draft), "--max-batch", "1", "--quiet"]
    cli.main([*args, "--out", str(tmp_path / "e")])
    limits = json.loads((tmp_path / "e" / "manifest.json").read_text())["limits"]
    assert limits["max_seq_len"] == 96 and limits["max_prompt_chunk"] == 96
    with pytest.raises(SystemExit, match="--max-seq-len 97: the target supports at most 96"):
        cli.main([*args, "--out", str(tmp_path / "e2"), "--max-seq-len", "97"])


def test_help_loads_neither_torch_nor_onnx():
    """``--help`` of every command comes at once: the command lines (export's, distill's) import what
    a command runs only when it runs."""
    probe = ("import runpy, sys\n"
             "for module, *command in (['export'], ['export', 'build'], ['export', 'make-tiny'], "
             "['distill']):\n"
             "    sys.argv = [module, *command, '--help']\n"
             "    try:\n"
             "        runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
             "    except SystemExit:\n"
             "        pass\n"
             "print(sorted(m for m in ('torch', 'onnx', 'numpy', 'transformers') if m in sys.modules))\n")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[1])
    assert loaded.stdout.strip().splitlines()[-1] == "[]", loaded.stdout[-500:]
