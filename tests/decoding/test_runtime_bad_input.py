"""Bad input to ``python -m runtime.generate``, ``python -m bench`` and the ``Generator``
API: each is refused with one line that names the flag, file or prompt, before any work, and
nothing the user gave (engine directory, prompt files, earlier outputs) changes. Ctrl-C at any
moment exits 130 with one line."""
import io
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import runtime.generate as generate
from bench import decoding as bench
from runtime import Generator
from runtime.backends.ort import OrtBackend
from runtime.decoding.batch import Decoding

from conftest import CLI_LIMITS

ROOT = Path(__file__).resolve().parents[2]
TOO_LONG = "word " * 200          # more tokens than the engine's 128 KV-cache rows


@pytest.fixture(scope="module")
def engine(engine_dir):
    return engine_dir(CLI_LIMITS, arch="llama")


@pytest.fixture(scope="module")
def generator(engine):
    return Generator.from_engine(engine)


@pytest.fixture
def prompts_file(tmp_path):
    """``prompts_file(*turns) -> path`` of a JSON Lines file with one record per turn."""
    def write(*prompts, name="prompts.jsonl") -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in prompts))
        return path

    return write


@pytest.fixture
def no_engine_load(monkeypatch):
    """Input that can be checked without the engine must be refused before it is loaded."""
    def load(*args, **kwargs):
        raise AssertionError("the engine was loaded before the input was checked")

    monkeypatch.setattr(Generator, "from_engine", load)


@pytest.fixture
def backend_starts(monkeypatch) -> list[int]:
    """The batch of every ``OrtBackend.start``: empty when no generation began."""
    starts, real = [], OrtBackend.start

    def start(self, batch):
        starts.append(batch)
        return real(self, batch)

    monkeypatch.setattr(OrtBackend, "start", start)
    return starts


def files(*paths: Path) -> dict[str, bytes]:
    """Every file under ``paths`` with its bytes: what a refused command must leave as it was."""
    found = {}
    for path in paths:
        for f in [path] if path.is_file() else sorted(path.rglob("*")):
            if f.is_file():
                found[str(f)] = f.read_bytes()
    return found


def refused(main, argv, capsys, *kept: Path) -> str:
    """Run a CLI in-process on bad input: it must exit with one line ``error: ...`` (status 1),
    print nothing else, and leave ``kept`` unchanged. Returns the line."""
    before = files(*kept)
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    message = exit_info.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message
    assert out == "" and err == ""
    assert files(*kept) == before
    return message


# --- outputs are checked before the work that fills them -------------------------------------


@pytest.mark.parametrize("flag", ["--out", "--plot"])
def test_bench_output_in_a_missing_folder_is_refused_before_work(engine, prompts_file, tmp_path,
                                                                  capsys, no_engine_load, flag):
    prompts = prompts_file("the cat")
    outputs = {"--out": tmp_path / "bench.json", "--plot": tmp_path / "bench.png"}
    for path in outputs.values():
        path.write_text("an earlier run")
    outputs[flag] = tmp_path / "missing" / "x"
    message = refused(bench.main, ["--engine", engine, "--prompts-file", prompts, "--no-transformers",
                                   "--force", *(a for f, p in outputs.items() for a in (f, p))],
                      capsys, engine, prompts, tmp_path)
    assert f"{flag} {outputs[flag]}: the folder {tmp_path / 'missing'} does not exist" in message


@pytest.mark.parametrize("flag", ["--out", "--plot"])
def test_bench_keeps_an_earlier_result_without_force(engine, prompts_file, tmp_path, capsys, no_engine_load,
                                                     flag):
    """An existing ``--out`` or ``--plot`` is not replaced unless ``--force`` says so (``build``'s
    rule): it was overwritten silently."""
    prompts = prompts_file("the cat")
    outputs = {"--out": tmp_path / "bench.json", "--plot": tmp_path / "bench.png"}
    outputs[flag].write_text("an earlier run")
    message = refused(bench.main, ["--engine", engine, "--prompts-file", prompts, "--no-transformers",
                                   *(a for f, p in outputs.items() for a in (f, p))],
                      capsys, engine, prompts, tmp_path)
    assert message == f"error: {flag} {outputs[flag]} exists; pass --force to replace it"


def test_generate_trace_in_a_missing_folder_is_refused_before_work(engine, capsys, tmp_path,
                                                                    no_engine_load):
    trace = tmp_path / "missing" / "t.jsonl"
    message = refused(generate.main, ["--engine", engine, "--prompt", "hi", "--trace", trace],
                      capsys, engine)
    assert f"--trace {trace}: the folder" in message and not trace.parent.exists()


# --- every prompt fits the KV cache, checked before the first batch runs ------------------------


@pytest.mark.parametrize("mode", [[], ["--stream"]])
def test_generate_names_the_prompt_over_capacity_before_any_work(engine, prompts_file, capsys,
                                                                  backend_starts, mode):
    prompts = prompts_file("one", "two", "three", "four", TOO_LONG)
    message = refused(generate.main, ["--engine", engine, "--prompts-file", prompts,
                                      "--max-new-tokens", "8", *mode], capsys, engine, prompts)
    assert "prompt 5 " in message and "the capacity is 128" in message
    assert backend_starts == []


def test_api_checks_every_batch_before_the_first(generator, backend_starts):
    with pytest.raises(ValueError, match=r"prompt 3 \('word word .*the capacity is 128"):
        generator.decodings(["one", "two", TOO_LONG], max_new_tokens=8)
    with pytest.raises(ValueError, match="prompt 3 "):
        generator.generate(["one", "two", TOO_LONG], max_new_tokens=8)
    with pytest.raises(ValueError, match="prompt 2 "):
        Decoding(generator.backend, [[5] * 10, [5] * 200], max_new_tokens=8)
    assert backend_starts == []


# --- sampling options and numeric flags -----------------------------------------------------


@pytest.mark.parametrize("flag, value", [("--temperature", "nan"), ("--temperature", "inf"),
                                         ("--temperature", "2.5"),
                                         ("--top-p", "nan"), ("--top-p", "inf"),
                                         ("--temperature", "-1.0"), ("--top-p", "0.0"),
                                         ("--max-new-tokens", "0"), ("--confidence-threshold", "1.5"),
                                         ("--limit", "0"), ("--limit", "-1"),
                                         ("--batch-size", "0"), ("--batch-size", "-1"),
                                         ("--threads", "0"), ("--threads", "-1")])
def test_generate_refuses_bad_numbers_before_loading(engine, capsys, tmp_path, no_engine_load,
                                                      flag, value):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("an earlier run")
    message = refused(generate.main, ["--engine", engine, "--prompt", "hi", "--trace", trace,
                                      flag, value], capsys, engine, trace)
    assert message.startswith(f"error: {flag} {value}: expected ")


def test_generate_refuses_a_batch_size_above_the_engines(engine, capsys, backend_starts):
    message = refused(generate.main, ["--engine", engine, "--prompt", "hi", "--batch-size", "3"],
                      capsys, engine)
    assert message.startswith("error: --batch-size 3: expected ") and "2" in message
    assert backend_starts == []


@pytest.mark.parametrize("flag, value", [("--limit", "0"), ("--limit", "-1"), ("--threads", "0"),
                                         ("--threads", "-1"), ("--prompt-lookup", "-1"),
                                         ("--temperature", "nan"), ("--max-new-tokens", "0"),
                                         ("--skip", "-1")])
def test_bench_refuses_bad_numbers_before_loading(engine, prompts_file, tmp_path, capsys,
                                                  no_engine_load, flag, value):
    prompts = prompts_file("the cat", "a dog")
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    out.write_text("an earlier run")
    message = refused(bench.main, ["--engine", engine, "--prompts-file", prompts, "--out", out,
                                   "--plot", plot, flag, value], capsys, engine, prompts, tmp_path)
    assert message.startswith(f"error: {flag} {value}: expected ")
    assert not plot.exists()


@pytest.mark.parametrize("option, value", [("temperature", math.nan), ("temperature", math.inf),
                                           ("temperature", 3.5), ("top_p", math.nan), ("top_p", math.inf)])
def test_api_refuses_non_finite_sampling_options(generator, backend_starts, option, value):
    with pytest.raises(ValueError, match=f"{option} {value}: expected"):
        Decoding(generator.backend, [[5, 6, 7]], **{option: value})
    with pytest.raises(ValueError, match=f"{option} {value}: expected"):
        generator.generate("hi", **{option: value})
    assert backend_starts == []


def test_api_refuses_batch_size_and_threads_out_of_range(generator, engine, backend_starts):
    for size in (0, -1, 3):
        with pytest.raises(ValueError, match=f"batch_size {size}: expected 1 .. 2"):
            generator.decodings(["hi"], batch_size=size)
    for threads in (0, -1):
        with pytest.raises(ValueError, match=f"threads {threads}: expected at least 1"):
            OrtBackend(engine, threads=threads)
    assert backend_starts == []


# --- where prompts come from ------------------------------------------------------------------


class UnreadableStdin(io.StringIO):
    """Standard input that is an open pipe (not a terminal) and must not be read."""

    def isatty(self) -> bool:
        return False

    def read(self, *args):
        raise AssertionError("standard input was read")

    buffer = property(lambda self: self)


@pytest.mark.parametrize("content", ["", "\n  \n"])
@pytest.mark.parametrize("cli", ["generate", "bench"])
def test_an_empty_prompts_file_is_refused_and_stdin_left_alone(engine, tmp_path, capsys, monkeypatch,
                                                               no_engine_load, content, cli):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    monkeypatch.setattr(sys, "stdin", UnreadableStdin())
    main = generate.main if cli == "generate" else bench.main
    message = refused(main, ["--engine", engine, "--prompts-file", empty, "--out", tmp_path / "b.json"]
                      if cli == "bench" else ["--engine", engine, "--prompts-file", empty],
                      capsys, engine, empty)
    assert f"--prompts-file {empty}: no prompts" in message


def test_non_utf8_standard_input_is_refused(engine, capsys, monkeypatch, no_engine_load):
    # as Python reads a pipe in a C.UTF-8 locale: undecodable bytes become lone surrogates
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9 ok\n"), encoding="utf-8", errors="surrogateescape")
    monkeypatch.setattr(sys, "stdin", stdin)
    message = refused(generate.main, ["--engine", engine], capsys, engine)
    assert "standard input" in message and "UTF-8" in message


@pytest.mark.parametrize("line, expected", [
    ('{"turns": ["caf\xe9"]}'.encode("latin-1"), "prompts.jsonl:2: not UTF-8"),
    (b'{"turns": [42]}', "prompts.jsonl:2: expected a JSON object with a non-empty list 'turns' of strings"),
    (b'{"turns": []}', "prompts.jsonl:2: expected a JSON object with a non-empty list 'turns'"),
])
def test_bad_prompts_file_lines_are_named(engine, tmp_path, capsys, no_engine_load, line, expected):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"turns": ["fine"]}\n' + line + b"\n")
    message = refused(generate.main, ["--engine", engine, "--prompts-file", prompts], capsys,
                      engine, prompts)
    assert f"--prompts-file {prompts.parent}/{expected}" in message


# --- a damaged engine directory ----------------------------------------------------------------


@pytest.mark.parametrize("damage", ["target.onnx missing", "draft.onnx missing", "target.onnx truncated",
                                    "draft.onnx truncated", "tokenizer missing"])
def test_a_damaged_engine_directory_is_named_with_what_to_do(engine, tmp_path, capsys, damage):
    copy = Path(shutil.copytree(engine, tmp_path / "engine"))
    name, how = damage.split()
    path = copy / name
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    message = refused(generate.main, ["--engine", copy, "--prompt", "hi"], capsys, copy)
    assert str(path) in message and "rebuild" in message


# --- streaming keeps its statistics and trace -----------------------------------------------------


def test_stream_prints_stats_and_writes_the_trace(engine, generator, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    generate.main(["--engine", str(engine), "--prompt", "the cat sat", "--prompt", "why?",
                   "--max-new-tokens", "16", "--stream", "--stats", "--trace", str(trace),
                   "--draft-schedule", "4"])   # every draft verified: steps do not depend on timing
    out, err = capsys.readouterr()
    expected = generator.generate(["the cat sat", "why?"], max_new_tokens=16,
                                  draft_schedule=generator.draft_schedule("4"))
    assert f"### the cat sat\n{expected.texts[0]}" in out and f"### why?\n{expected.texts[1]}" in out
    tokens = sum(map(len, expected.token_ids))
    assert f"tokens {tokens} in" in err and f"{expected.stats.steps} steps verified drafts, tau" in err
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    for b, ids in enumerate(expected.token_ids):
        assert [t for r in records if r["sequence"] == b for t in r["emitted"]] == ids


def test_api_stream_exposes_the_statistics(generator):
    # every draft verified: adaptive caps follow the acceptance seen so far, so two runs differ
    every = generator.draft_schedule("4")
    decoding = generator.decodings(["the cat sat"], max_new_tokens=16, draft_schedule=every)[0]
    text = "".join(generator.pieces(decoding))
    expected = generator.generate("the cat sat", max_new_tokens=16, draft_schedule=every)
    assert text == expected.texts[0]
    assert decoding.result.stats == expected.stats and decoding.result.token_ids == expected.token_ids


# --- Ctrl-C -----------------------------------------------------------------------------------------


def test_importing_the_package_does_not_import_torch():
    """``python -m runtime.generate`` imports ``runtime`` before ``main`` can catch Ctrl-C."""
    code = "import sys, runtime; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def _interrupted(command: list, when) -> subprocess.CompletedProcess:
    """Run ``command``, send SIGINT after ``when`` seconds (or once it printed a line), return the run."""
    # a shell without job control starts background commands with SIGINT ignored, and children
    # inherit that (Python then installs no KeyboardInterrupt handler): give the command the default
    process = subprocess.Popen([sys.executable, "-m", *map(str, command)], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if when == "first output":
        process.stdout.readline()
    else:
        time.sleep(when)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


@pytest.mark.parametrize("when", [0.3, 2.5, "first output"])
def test_ctrl_c_at_any_moment_of_generate_exits_cleanly(engine, prompts_file, when):
    prompts = prompts_file(*(f"prompt number {i}" for i in range(400)))
    run = _interrupted(["runtime.generate", "--engine", engine, "--prompts-file", prompts,
                        "--max-new-tokens", "64", "--stream"], when)
    assert run.returncode == 130 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "interrupted" in run.stderr


def test_ctrl_c_while_importing_bench_exits_cleanly(engine, prompts_file, tmp_path):
    prompts = prompts_file("the cat")
    run = _interrupted(["bench", "--engine", engine, "--prompts-file", prompts,
                        "--out", tmp_path / "b.json", "--plot", tmp_path / "b.png"], 0.3)
    assert run.returncode == 130 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "interrupted" in run.stderr


@pytest.mark.parametrize("cli", ["generate", "bench"])
@pytest.mark.parametrize("stage", ["backends.ort.OrtBackend.__init__", "decoding.executor.prefill_chunks"])
def test_ctrl_c_while_loading_or_running_exits_130(engine, prompts_file, tmp_path, capsys, monkeypatch,
                                                   cli, stage):
    module, name = stage.rsplit(".", 1)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(f"runtime.{module}.{name}", interrupt)
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as exit_info:
        try:
            if cli == "generate":
                generate.main(["--engine", str(engine), "--prompt", "hi", "--max-new-tokens", "8", "--stats"])
            else:
                bench.main(["--engine", str(engine), "--prompts-file", str(prompts_file("hi")),
                            "--out", str(out), "--plot", str(tmp_path / "bench.png")])
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C went through main")
    assert exit_info.value.code == 130
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "interrupted" in err
    assert not out.exists()
