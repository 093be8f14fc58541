"""``python -m runtime.generate`` and the ``Generator`` API over an engine directory."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import runtime.generate as cli
from common.manifest import SCHEMA_VERSION
from runtime import Generator
from runtime.backends.ort import OrtBackend

from conftest import CLI_LIMITS, hf_greedy

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["the cat sat", "once upon a time, there was", "why?"]


@pytest.fixture(scope="module")
def engine(engine_dir):
    return engine_dir(CLI_LIMITS, arch="llama")


@pytest.fixture(scope="module")
def generator(engine):
    return Generator.from_engine(engine)


def _run(engine, *args) -> str:
    return ["--engine", str(engine), "--max-new-tokens", "24", *args]


def test_api_greedy_equals_transformers_in_batches(generator, tiny):
    """Three prompts through an engine of max batch 2: two batches, the invariant holds. Unless
    told, the ONNX Runtime backend batches up to the engine's max batch where the compiled
    kernels run a batch in one call, and runs a prompt per batch where they do not (batching is
    no faster there)."""
    sizes = [len(d.prompts) for d in generator.decodings(PROMPTS, max_new_tokens=24, chat_template=False)]
    assert sizes == ([2, 1] if generator.backend.batched else [1, 1, 1])
    result = generator.generate(PROMPTS, max_new_tokens=24, chat_template=False, batch_size=2,
                                draft_schedule=generator.draft_schedule("4"))  # steps verify drafts
    tokenizer = AutoTokenizer.from_pretrained(tiny(arch="llama")[0])
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert result.token_ids == hf_greedy(tiny(arch="llama")[0], ids, 24)
    assert result.texts == [generator.decode(t) for t in result.token_ids]
    assert result.stats.steps > 0 and result.times.total >= result.times.verify > 0
    assert {r["sequence"] for r in result.trace} == {0, 1, 2}


def test_api_stream_pieces_make_the_text(generator):
    pieces = list(generator.stream("the cat sat", max_new_tokens=24))
    assert len(pieces) > 1
    assert "".join(pieces) == generator.generate("the cat sat", max_new_tokens=24).texts[0]


def test_chat_template_is_on_by_default(generator):
    ids = generator.encode("hi")
    assert ids[0] == generator.tokenizer.convert_tokens_to_ids("<|user|>")
    assert generator.encode("hi", chat_template=False) == generator.tokenizer.encode("hi")


def test_cli_prints_text_stats_and_a_consistent_trace(engine, generator, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)   # a terminal is told what loads
    trace = tmp_path / "trace.jsonl"
    cli.main(_run(engine, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--stats", "--trace", str(trace),
                  "--draft-schedule", "4"))   # every draft verified
    out, err = capsys.readouterr()
    expected = generator.generate(PROMPTS[:2], max_new_tokens=24)
    for prompt, text in zip(PROMPTS, expected.texts):
        assert f"### {prompt}\n{text}\n" in out
    assert "tau" in err and "acceptance per draft position" in err and "host" in err
    assert err.startswith(f"loading {engine} (ort backend) ...\n")
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    for b, ids in enumerate(expected.token_ids):
        emitted = [t for r in records if r["sequence"] == b for t in r["emitted"]]
        assert emitted == ids
        steps = [r for r in records if r["sequence"] == b and r["step"] > 0]
        assert all(len(r["drafts"]) == 4 and 0 <= r["accepted"] <= 4 for r in steps)


def test_a_seed_gives_one_text_through_the_cli_and_the_api_whatever_is_verified(engine, generator, capsys):
    """A sampled token is the target's own sample for the seed (``runtime/decoding/noise.py``):
    adaptive verification (the default), a fixed cap, and no speculation print one text, the
    API's."""
    sampled = ["--prompt", PROMPTS[1], "--temperature", "0.8", "--top-p", "0.95", "--seed", "7"]
    printed = set()
    for verification in ([], ["--no-spec"], ["--draft-schedule", "1"], ["--draft-schedule", "4"], []):
        cli.main(_run(engine, *sampled, *verification))
        printed.add(capsys.readouterr().out)
    text = generator.generate(PROMPTS[1], max_new_tokens=24, temperature=0.8, top_p=0.95, seed=7).texts[0]
    assert printed == {f"### {PROMPTS[1]}\n{text}\n\n"}
    assert text != generator.generate(PROMPTS[1], max_new_tokens=24, temperature=0.8, top_p=0.95,
                                      seed=8).texts[0]


def test_the_api_verifies_adaptively_by_default_as_the_cli_does(engine, generator, monkeypatch):
    """``generate`` / ``decodings`` without a ``draft_schedule`` plan with adaptive verification
    (measured once per generator), after every prompt is checked: a prompt that cannot fit is
    refused before the ~2 s measurement."""
    from runtime.decoding import generator as api
    from runtime.decoding.adaptive import AdaptiveSchedule
    from runtime.decoding.draft_schedule import LoadSchedule

    [decoding] = generator.decodings([PROMPTS[0]], max_new_tokens=24)
    assert isinstance(decoding.batcher.scheduler.draft_schedule, AdaptiveSchedule)
    assert decoding.batcher.scheduler.draft_schedule is generator.draft_schedule()
    [fixed] = generator.decodings([PROMPTS[0]], max_new_tokens=24, draft_schedule=LoadSchedule.constant(2))
    assert fixed.batcher.scheduler.draft_schedule == LoadSchedule.constant(2)
    measured = []
    monkeypatch.setattr(api, "adaptive", lambda backend: measured.append(backend))
    fresh = Generator.from_engine(engine)
    with pytest.raises(ValueError, match="prompt 2 .* tokens"):
        fresh.decodings(["hi", "word " * 200], max_new_tokens=24)
    assert not measured
    fresh.decodings(["hi"], max_new_tokens=24, speculative=False)
    assert not measured


def test_cli_stream_and_no_spec_print_the_same_text(engine, capsys):
    cli.main(_run(engine, "--prompt", "the cat sat"))
    plain = capsys.readouterr().out
    cli.main(_run(engine, "--prompt", "the cat sat", "--stream"))
    assert capsys.readouterr().out.strip() == plain.strip()
    cli.main(_run(engine, "--prompt", "the cat sat", "--no-spec", "--stats"))
    out, err = capsys.readouterr()
    assert out == plain
    # target-only decoding verifies nothing: no tau or acceptance, its steps named as they are
    assert "decode steps" in err and "tau" not in err and "acceptance" not in err


def test_cli_prompts_file_and_stdin(engine, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [p, "second turn"]}) + "\n" for p in PROMPTS))
    command = [sys.executable, "-m", "runtime.generate", *_run(engine)]

    def out(*args, stdin=None):
        done = subprocess.run([*command, *args], input=stdin, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    from_file = out("--prompts-file", str(prompts), "--limit", "2")
    from_stdin = out(stdin="\n".join(PROMPTS[:2]) + "\n")
    assert from_file == from_stdin and from_file.count("### ") == 2
    skipped = out("--prompts-file", str(prompts), "--skip", "1", "--limit", "1")
    assert skipped.count("### ") == 1 and skipped.split("### ")[1] == from_file.split("### ")[2]


def test_cli_torch_backend_matches_ort(engine, capsys):
    cli.main(_run(engine, "--prompt", "the cat sat"))
    ort_text = capsys.readouterr().out
    cli.main(_run(engine, "--prompt", "the cat sat", "--backend", "torch"))
    assert capsys.readouterr().out == ort_text


def test_ctrl_c_prints_what_was_generated(engine, capsys, monkeypatch):
    calls = {"n": 0}
    real = OrtBackend.target_step

    def interrupted(self, *args, **options):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real(self, *args, **options)

    monkeypatch.setattr(OrtBackend, "target_step", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(_run(engine, "--prompt", "the cat sat", "--stats", "--draft-schedule", "4"))
    assert exit_info.value.code == 130
    out, err = capsys.readouterr()
    assert "### the cat sat\n" in out and len(out.split("\n")[1]) >= 4   # prefill + 4 steps
    assert "interrupted" in err


@pytest.mark.parametrize("args, message", [
    (["--prompt", "x" * 200], r"needs \d+ KV-cache rows; the capacity is 128"),
    (["--prompt", "hi", "--max-new-tokens", "200"], "max_new_tokens .*200"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature -1"),
    (["--prompts-file", "/nonexistent.jsonl"], "--prompts-file /nonexistent.jsonl: no such file"),
    (["--prompt", "hi", "--skip", "1"], "--skip 1: expected at least 0 and fewer than the 1 prompts"),
    (["--prompt", "hi", "--confidence-threshold", "1.5"], r"--confidence-threshold 1.5: expected 0"),
])
def test_cli_bad_input(engine, args, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(["--engine", str(engine), *args])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="refused only without a GPU")
def test_torch_cuda_without_a_gpu_is_refused_before_loading(engine, monkeypatch):
    """(The TensorRT backends' refusal: ``tests/graphs/test_tensorrt_build.py``.)"""
    import runtime.backends.pytorch

    def never(*args, **kwargs):
        raise AssertionError("loaded")

    monkeypatch.setattr(runtime.backends.pytorch.TorchBackend, "from_engine", never)
    refused = "^error: --backend torch-cuda needs a CUDA GPU .*; use --backend ort"
    with pytest.raises(SystemExit, match=refused):
        cli.main(["--engine", str(engine), "--prompt", "hi", "--backend", "torch-cuda"])


def test_cli_bad_prompts_file_line(engine, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"prompt": "no turns"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:2: expected a JSON object with a non-empty list 'turns'"):
        cli.main(["--engine", str(engine), "--prompts-file", str(bad)])


def test_cli_refuses_missing_or_newer_manifest(engine, tmp_path):
    with pytest.raises(SystemExit, match="manifest.json: missing; build an engine directory"):
        cli.main(["--engine", str(tmp_path), "--prompt", "hi"])
    manifest = json.loads((engine / "manifest.json").read_text())
    newer = tmp_path / "newer"
    newer.mkdir()
    future = SCHEMA_VERSION + 1
    (newer / "manifest.json").write_text(json.dumps({**manifest, "schema_version": future}))
    with pytest.raises(SystemExit, match=f"schema_version {future} is newer .* upgrade dspark-trt"):
        cli.main(["--engine", str(newer), "--prompt", "hi"])


def test_torch_backend_needs_the_source_checkpoints(engine, tmp_path):
    import shutil

    moved = Path(shutil.copytree(engine, tmp_path / "engine"))
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["source"]["target"]["path"] = str(tmp_path / "gone")
    (moved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit, match="torch backend .* use --backend ort"):
        cli.main(["--engine", str(moved), "--prompt", "hi", "--backend", "torch"])
    cli.main(["--engine", str(moved), "--prompt", "hi", "--max-new-tokens", "4"])  # ort needs none


@pytest.mark.parametrize("module, args, message", [
    ("runtime.generate", ["--engine", "e", "--max-new-token", "3"],
     "unrecognized argument --max-new-token; did you mean --max-new-tokens?"),
    ("runtime.generate", ["--engine", "e", "--temprature", "0.5"],
     "unrecognized argument --temprature; did you mean --temperature?"),
    ("bench", ["--engine", "e", "--prompts-file", "p", "--limt", "2"],
     "unrecognized argument --limt; did you mean --limit?"),
    ("export", ["build", "--max-batchs", "2"],
     "unrecognized argument --max-batchs; did you mean --max-batch?"),
    # nothing close: no guess, and never --force, the flag that replaces output
    ("export", ["build", "--frobnicate", "3"],
     "unrecognized argument --frobnicate (python -m export build --help lists the flags)"),
    ("export", ["build", "--forc"],
     "unrecognized argument --forc (python -m export build --help lists the flags)"),
    ("runtime.generate", ["--prompt", "hi"], "the following arguments are required: --engine"),
])
def test_flags_are_taken_whole_and_a_typo_gets_the_nearest_flag(module, args, message):
    """argparse would take a prefix of a flag for the flag, and name no flag for a typo; each
    mistake is one line (argparse prints its whole usage text first), status 2."""
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    (line,) = done.stderr.splitlines()
    assert line == f"python -m {module.split()[0]}{' build' if args[0] == 'build' else ''}: error: {message}"


@pytest.mark.parametrize("script", ["dspark-generate", "dspark-bench", "dspark-chat", "dspark-export",
                                    "dspark-distill", "dspark-serve"])
@pytest.mark.slow
def test_console_scripts_are_installed(script):
    """``pip install -e .`` puts each command on the environment's PATH, and each names itself as
    typed (not ``python -m runtime.chat``) in its usage and errors."""
    path = Path(sys.executable).parent / script
    done = subprocess.run([str(path), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith(f"usage: {script} "), done.stdout[:200]
    assert f"python -m {script.removeprefix('dspark-')}" not in done.stdout.replace("runtime.", "")
    wrong = subprocess.run([str(path), "--no-such-flag"], capture_output=True, text=True)
    assert wrong.returncode == 2 and wrong.stderr.startswith(f"{script}: error: "), wrong.stderr


def test_a_stop_string_ends_the_sequence_and_its_text_before_it(generator):
    """A stop string that spans tokens, and steps that emit several tokens at once: the sequence
    ends at the token that completes it (speculative or not), its text and its stream end before
    it, and nothing after it is generated."""
    prompt = PROMPTS[1]
    full = generator.generate(prompt, max_new_tokens=24)
    text, ids = full.texts[0], full.token_ids[0]
    middle = len(generator.decode(ids[:12]))
    stop = text[middle - 1:middle + 2]          # three characters around a token boundary
    assert len(stop) == 3 and text.index(stop) == middle - 1
    for speculative in (True, False):
        cut = generator.generate(prompt, max_new_tokens=24, stop=[stop, "never in it"],
                                 speculative=speculative)
        assert cut.texts == [text[:middle - 1]]
        assert cut.token_ids[0] == ids[:len(cut.token_ids[0])] and len(cut.token_ids[0]) < len(ids)
        last = cut.token_ids[0]
        assert stop in generator.decode(last) and stop not in generator.decode(last[:-1])
    (decoding,) = generator.decodings([prompt], max_new_tokens=24, stop=[stop])
    pieces = list(generator.pieces(decoding))
    assert "".join(pieces) == text[:middle - 1] and all(stop not in piece for piece in pieces)


def test_cli_system_message_stop_and_top_k(engine, generator, capsys):
    with pytest.raises(SystemExit, match="--system: needs the tokenizer's chat template"):
        cli.main(_run(engine, "--prompt", "hi", "--system", "Be brief.", "--no-chat-template"))
    with pytest.raises(SystemExit, match="--top-k -1: expected at least 0"):
        cli.main(_run(engine, "--prompt", "hi", "--top-k", "-1"))
    system = generator.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert generator.encode("hi", system="Be brief.") == list(system) != generator.encode("hi")
    expected = generator.generate("hi", max_new_tokens=24, system="Be brief.").texts[0]
    cli.main(_run(engine, "--prompt", "hi", "--system", "Be brief.", "--top-k", "5"))
    assert capsys.readouterr().out == f"### hi\n{expected}\n\n"   # greedy: top-k changes nothing


def test_chat_streams_each_answer_and_keeps_the_conversation(engine, generator):
    """``python -m runtime.chat`` with its turns on standard input: each answer is the engine's
    greedy answer to the conversation so far, which includes the earlier answers; ``/reset``
    forgets them, ``/help`` lists the commands and ``/quit`` ends the chat, none of them sent to the
    model; a line that is not UTF-8 is refused in one line and the chat goes on."""
    turns = [b"hi", b"/help", b"caf\xe9", b"the cat sat", b"/reset", b"the cat sat", b"/quit", b"more"]
    done = subprocess.run([sys.executable, "-m", "runtime.chat", "--engine", str(engine),
                           "--max-new-tokens", "12"], input=b"\n".join(turns) + b"\n", cwd=ROOT,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    done.stdout, stderr = done.stdout.decode(), done.stderr.decode().splitlines()
    assert stderr[0].startswith("/reset ") and "/quit" in stderr[0] and "/help" in stderr[0]
    assert stderr[1:] == ["error: standard input line 3: not UTF-8 text (byte 0xe9); it was not sent",
                          "[the conversation starts over]"]
    messages, answers = [], []
    for turn in ("hi", "the cat sat"):
        messages.append({"role": "user", "content": turn})
        decoding = generator.conversation(messages, max_new_tokens=12)
        for _ in decoding:
            pass
        answers.append(generator.collect([decoding]).texts[0])
        messages.append({"role": "assistant", "content": answers[-1]})
    alone = generator.generate("the cat sat", max_new_tokens=12).texts[0]
    assert done.stdout == "".join(f"{answer}\n\n" for answer in [*answers, alone])
    assert answers[1] != alone   # the earlier turn is part of the second one's prompt


def test_all_turns_runs_each_record_as_a_conversation(engine, generator, tmp_path, capsys):
    prompts = tmp_path / "two-turns.jsonl"
    records = [{"turns": ["hi", "the cat sat"]}, {"turns": ["why?"]}]
    prompts.write_text("".join(json.dumps(record) + "\n" for record in records))
    with pytest.raises(SystemExit, match="--all-turns: needs --prompts-file"):
        cli.main(_run(engine, "--prompt", "hi", "--all-turns"))
    cli.main(_run(engine, "--prompts-file", str(prompts), "--all-turns"))
    expected = []
    for turns in (["hi", "the cat sat"], ["why?"]):
        messages = []
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            decoding = generator.conversation(messages, max_new_tokens=24)
            for _ in decoding:
                pass
            messages.append({"role": "assistant", "content": generator.collect([decoding]).texts[0]})
            expected.append(f"### {turn}\n{messages[-1]['content']}\n\n")
    assert capsys.readouterr().out == "".join(expected)


def test_stats_follow_the_text_when_stdout_and_stderr_share_a_pipe(engine):
    """``generate ... --stats 2>&1 | cat``: stdout is block-buffered in a pipe, so the statistics
    (stderr, unbuffered) came before the text they describe."""
    import os

    buffered = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-m", "runtime.generate", *_run(engine, "--prompt", "the cat sat",
                                                                           "--stats")],
                          cwd=ROOT, env=buffered, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          check=True)
    assert done.stdout.startswith("### the cat sat\n") and done.stdout.index("\ntokens ") > 0, done.stdout


def test_loading_an_engine_on_onnx_runtime_imports_and_loads_only_what_it_runs(engine):
    """What the first token waits for: each graph gets one ONNX Runtime session, and neither
    onnxscript (the exporter's) nor transformers' AutoTokenizer index of every model family is
    imported (the engine's tokenizer names its class; together about 1 s of a 5 s start)."""
    probe = ("import sys, onnxruntime\n"
             "sessions = []\n"
             "class Counted(onnxruntime.InferenceSession):\n"
             "    def __init__(self, *args, **kwargs):\n"
             "        sessions.append(1)\n"
             "        super().__init__(*args, **kwargs)\n"
             "onnxruntime.InferenceSession = Counted\n"
             "from runtime import Generator\n"
             f"Generator.from_engine({str(engine)!r})\n"
             "unneeded = ('onnxscript', 'transformers.models.auto')\n"
             "print(len(sessions), sorted(m for m in unneeded if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr[-2000:]


def test_the_engines_tokenizer_is_the_one_auto_tokenizer_loads(engine, generator):
    """Loaded by the class its tokenizer_config.json names, it is what AutoTokenizer gives."""
    from common.prompts import encode_prompt

    auto = AutoTokenizer.from_pretrained(engine / "tokenizer")
    ours = generator.tokenizer
    assert type(ours) is type(auto) and ours.chat_template == auto.chat_template
    assert ours.all_special_tokens == auto.all_special_tokens and ours.eos_token_id == auto.eos_token_id
    for prompt in PROMPTS:
        assert encode_prompt(ours, prompt) == encode_prompt(auto, prompt)
        assert ours.decode(encode_prompt(ours, prompt)) == auto.decode(encode_prompt(auto, prompt))
