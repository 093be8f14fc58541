"""``python -m export`` never loses what the user gave: a failed or interrupted ``build --force``
leaves the previous engine byte-identical, and an ``--out`` whose replacement would delete a source
checkpoint or the current folder is refused before any work."""
import hashlib
import os
import shutil
import signal
from pathlib import Path

import pytest

import export.__main__ as cli
import export.build
from common import manifest

from conftest import LIMITS

SMALL = ["--max-seq-len", "64", "--max-prompt-chunk", "16", "--max-batch", "2", "--quiet"]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (hidden ones included) by relative path -> sha256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def build_args(target, draft, out, *extra) -> list[str]:
    return ["build", "--target", str(target), "--draft", str(draft), "--out", str(out), *SMALL, *extra]


def refused(argv: list[str], *words: str) -> str:
    """Run the CLI, expect one ``error:`` line holding ``words``, and return it."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    message = str(exit_info.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    for word in words:
        assert word in message, message
    return message


@pytest.fixture(scope="module")
def built_once(engine_dir):
    """An engine of ``tiny()``'s pair (read-only: tests copy it)."""
    return engine_dir(LIMITS)


@pytest.fixture
def previous_engine(built_once, tmp_path):
    """A copy of a built engine at ``tmp_path/engine``, and its snapshot."""
    out = Path(shutil.copytree(built_once, tmp_path / "engine"))
    return out, snapshot(out)


def leftovers(out: Path) -> list[str]:
    """Staging or retired folders a build left beside ``out``."""
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.mark.slow
@pytest.mark.parametrize("mistake", ["typo-in-target", "refused-k"])
def test_failed_force_build_keeps_the_previous_engine(tiny, previous_engine, mistake):
    out, before = previous_engine
    target, draft = tiny()
    if mistake == "typo-in-target":
        refused(build_args(target.parent / "tagret", draft, out, "--force"), "--target", "tagret")
    else:
        refused(build_args(target, draft, out, "--force", "--k", "9"), "--k 9")
    assert snapshot(out) == before
    assert leftovers(out) == []


@pytest.mark.slow
def test_interrupted_force_build_keeps_the_previous_engine(tiny, previous_engine, monkeypatch):
    out, before = previous_engine
    real_export = export.build.export_graph

    def export_then_interrupt(*args, **kwargs):
        real_export(*args, **kwargs)
        raise KeyboardInterrupt   # Ctrl-C after the first graph is written

    monkeypatch.setattr(export.build, "export_graph", export_then_interrupt)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(build_args(*tiny(), out, "--force"))
    assert exit_info.value.code == 130
    assert snapshot(out) == before
    assert leftovers(out) == []


@pytest.mark.slow
def test_killed_force_build_keeps_the_previous_engine(tiny, previous_engine, monkeypatch):
    """A plain ``kill`` (SIGTERM) is handled as any failure: the staging folder is removed."""
    out, before = previous_engine
    real_export = export.build.export_graph

    def export_then_terminate(*args, **kwargs):
        real_export(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(export.build, "export_graph", export_then_terminate)
    default = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(build_args(*tiny(), out, "--force"))
    finally:
        signal.signal(signal.SIGTERM, default)
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert snapshot(out) == before
    assert leftovers(out) == []


@pytest.mark.slow
def test_full_disk_while_writing_an_engine_is_one_line(tiny, previous_engine, monkeypatch):
    """TensorRT only logs an exception raised in its stream writer and carries on: the writer
    keeps the error, and the build stops with it (here every write goes to /dev/full)."""
    pytest.importorskip("tensorrt_rtx")
    from export import trt_build

    out, before = previous_engine
    real_writer = trt_build._FileWriter
    full = open("/dev/full", "wb", buffering=0)
    monkeypatch.setattr(trt_build, "_FileWriter", lambda trt, file: real_writer(trt, full))
    refused(build_args(*tiny(), out, "--force", "--backend", "trt-rtx"),
            "No space left on device", "target.sm89.engine", "no output was changed")
    full.close()
    assert snapshot(out) == before
    assert leftovers(out) == []


@pytest.mark.slow
def test_force_build_replaces_the_engine_and_leaves_nothing_beside_it(tiny, previous_engine):
    out, before = previous_engine
    (out / "stale.txt").write_text("from an earlier build")
    cli.main(build_args(*tiny(), out, "--force", "--k", "2"))
    after = snapshot(out)
    assert "stale.txt" not in after and after["manifest.json"] != before["manifest.json"]
    assert manifest.read(out)["draft"]["k"] == 2     # --k reaches the engine
    assert leftovers(out) == []


@pytest.mark.parametrize("which", ["target", "draft", "parent-of-target"])
def test_out_that_is_or_holds_a_source_is_refused(tiny, tmp_path, which):
    pair = Path(shutil.copytree(tiny()[0].parent, tmp_path / "pair"))
    target, draft = pair / "target", pair / "draft"
    out = {"target": target, "draft": draft, "parent-of-target": pair}[which]
    before = snapshot(pair)
    refused(build_args(target, draft, out, "--force"), "--out", "would delete the input")
    assert snapshot(pair) == before


def test_out_that_is_or_holds_the_current_folder_is_refused(tiny, tmp_path, monkeypatch):
    work = tmp_path / "work"
    (work / "notes").mkdir(parents=True)
    (work / "notes" / "keep.txt").write_text("mine")
    monkeypatch.chdir(work / "notes")
    for out in (".", ".."):
        refused(build_args(*tiny(), out, "--force"), f"--out {out}", "the current folder")
    assert snapshot(work) == {"notes/keep.txt": hashlib.sha256(b"mine").hexdigest()}


def test_out_that_is_a_file_is_refused(tiny, tmp_path):
    file = tmp_path / "engine"
    file.write_text("not an engine")
    refused(build_args(*tiny(), file, "--force"), "is a file")
    assert file.read_text() == "not an engine"


def test_make_tiny_force_that_fails_keeps_the_previous_pair(tmp_path):
    out = tmp_path / "pair"
    cli.main(["make-tiny", str(out)])
    before = snapshot(out)
    refused(["make-tiny", str(out), "--force", "--draft-vocab", "2"], "--draft-vocab 2")
    assert snapshot(out) == before
    assert leftovers(out) == []


@pytest.mark.parametrize("flags, words", [
    (["--name", "a/b"], ["--name 'a/b'", "a Triton model name"]),
    (["--instances", "0"], ["--instances 0"]),
    (["--backend", "tensorflow"], ["--backend tensorflow", "ort"]),
    (["--draft-schedule", "1:99"], ["--draft-schedule '1:99'", "the engine's k"]),
])
def test_a_bad_triton_repo_flag_is_one_line_and_writes_nothing(built_once, tmp_path, flags, words):
    refused(["triton-repo", str(built_once), str(tmp_path / "models"), *flags], *words)
    assert not (tmp_path / "models").exists()


def test_triton_repo_keeps_the_other_models_and_an_existing_one_without_force(built_once, tmp_path):
    models = tmp_path / "models"
    (models / "other" / "1").mkdir(parents=True)
    (models / "other" / "config.pbtxt").write_text("mine")
    cli.main(["triton-repo", str(built_once), str(models), "--name", "m"])
    config = (models / "m" / "config.pbtxt").read_text()
    assert f'string_value: "{built_once.resolve()}"' in config and "decoupled: true" in config
    refused(["triton-repo", str(built_once), str(models), "--name", "m"], "OUT/NAME", "--force")
    assert (models / "m" / "config.pbtxt").read_text() == config
    assert (models / "other" / "config.pbtxt").read_text() == "mine"


def test_a_model_repository_written_before_the_serving_move_loads_the_same_model(built_once, tmp_path):
    """Repositories written before the Triton model moved into ``runtime/serving/`` import it as
    ``runtime.triton_model``; theirs and a new repository's ``model.py`` give Triton one class."""
    import runpy

    models = tmp_path / "models"
    cli.main(["triton-repo", str(built_once), str(models), "--name", "m"])
    old = tmp_path / "old_model.py"
    old.write_text("from runtime.triton_model import TritonPythonModel  # noqa: F401\n")
    new = runpy.run_path(str(models / "m" / "1" / "model.py"))["TritonPythonModel"]
    assert runpy.run_path(str(old))["TritonPythonModel"] is new
    assert new.__module__ == "runtime.serving.tritonserver_model"
