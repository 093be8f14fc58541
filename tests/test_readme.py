"""Every command README shows runs as shown, so that none goes stale: each command line's flags are
its parser's (and a synopsis lists all of them), the scripts and files it names exist, and its
first steps, its `curl` and `openai` calls and its Python API run against a tiny engine copied to
the path README uses. The one command not run here is `python -m export build` with no pair (the
demo pair, minutes): `tests/graphs/test_gguf.py::test_build_with_no_pair_builds_the_demo_pair_and_it_runs`
runs that command line."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LONG_LIMITS, ROOT, free_port, wait_until_serving

README = (ROOT / "README.md").read_text()
DEMO = "engines/smollm2-135m-instruct"
# room for README's default lengths (chat's 256 new tokens) after a templated prompt
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
WITH_SUBCOMMANDS = ("export", "bench.llama_cpp_tools")


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.S | re.M)


def commands(block: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = (re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def cli_of(command: str) -> tuple[str, ...] | None:
    """``("export", "build")`` for ``python -m export build ...``: the module and its subcommand."""
    words = shlex.split(command)
    if words[:2] != ["python", "-m"]:
        return None
    module, rest = words[2], words[3:]
    if module in WITH_SUBCOMMANDS and rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]):
        return module, rest[0]
    return (module,)


ALL = [command for block in blocks("bash") for command in commands(block)]


def test_readme_is_a_guide_of_at_most_250_lines():
    assert len(README.splitlines()) <= 250


def test_every_flag_shown_is_its_commands_and_every_synopsis_is_complete():
    """A flag README shows that the command does not take is stale; a command shown with a
    bracketed synopsis lists every flag its ``--help`` does."""
    shown: dict[tuple, set[str]] = {}
    synopsis: set[tuple] = set()
    for command in ALL:
        cli = cli_of(command)
        if cli:
            shown.setdefault(cli, set()).update(FLAG.findall(command))
            if "[" in command:
                synopsis.add(cli)
    assert len(shown) >= 10, shown
    for cli, flags in shown.items():
        help_text = subprocess.run([sys.executable, "-m", *cli, "--help"], cwd=ROOT, capture_output=True,
                                   env={**os.environ, "COLUMNS": "100000"},   # no flag wrapped
                                   text=True, check=True).stdout
        taken = {flag for line in help_text.splitlines() if line.startswith("  -")   # an option's own line
                 for flag in FLAG.findall(re.split(r"\s{2,}", line.strip())[0])} - {"--help"}
        name = " ".join(cli)
        assert flags <= taken, f"{name}: README shows {sorted(flags - taken)}, which it does not take"
        if cli in synopsis:
            assert taken <= flags, f"{name}: README's synopsis lacks {sorted(taken - flags)}"


def test_every_script_and_file_readme_names_exists():
    for command in ALL:
        words = shlex.split(command)
        if words[0] == "bash":
            script = ROOT / words[1]
            assert script.is_file(), command
            subprocess.run(["bash", "-n", str(script)], check=True)
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link
    for path in re.findall(r"`((?:scripts|docs|modeling|common|tests|runtime|data)/[\w./-]+)`", README):
        assert (ROOT / path).exists(), path


@pytest.fixture(scope="module")
def home(engine_dir, tmp_path_factory) -> Path:
    """A folder holding README's demo engine path, a tiny engine copied there (the server names
    its model after the folder, as README's calls expect)."""
    folder = tmp_path_factory.mktemp("readme")
    shutil.copytree(engine_dir(LONG_LIMITS, arch="qwen3"), folder / DEMO)
    return folder


def run(command: str, home: Path, **options) -> subprocess.CompletedProcess:
    words = shlex.split(command)
    assert words[0] == "python", command
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *words[1:]], cwd=home, env=env, capture_output=True, text=True,
                          timeout=300, **options)


def first_steps() -> list[str]:
    return commands(blocks("bash")[1])


def test_first_steps_run_as_shown(home):
    steps = first_steps()
    assert steps[0] == "python -m export build", steps    # test_gguf runs it (the demo pair: minutes)
    for command in steps[1:]:
        if cli_of(command) == ("runtime.serve",):
            continue                                       # test_the_server_answers_readmes_calls
        stdin = "What is 12 * 7?\n/help\n/quit\n" if cli_of(command) == ("runtime.chat",) else None
        result = run(command, home, input=stdin)
        assert result.returncode == 0, (command, result.stderr[-2000:])
        assert result.stdout.strip(), command
        if "--stats" in command:
            assert "tau" in result.stderr and "acceptance per draft position" in result.stderr


def test_the_server_answers_readmes_calls(home):
    """README's server command, then its `curl` and its `openai` calls, each as shown but for the
    port (a free one)."""
    (serve,) = [c for c in first_steps() if cli_of(c) == ("runtime.serve",)]
    port = str(free_port())
    words = shlex.split(serve.replace("--port 8000", f"--port {port}"))
    process = subprocess.Popen([sys.executable, *words[1:], "--threads", "1"], cwd=home,
                               env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until_serving(process, f"http://127.0.0.1:{port}/health", 120)
        (curl,) = commands(blocks("bash")[2])
        reply = subprocess.run(curl.replace(":8000", f":{port}"), shell=True, capture_output=True,
                               text=True, check=True, timeout=120).stdout
        message = json.loads(reply)["choices"][0]["message"]
        assert isinstance(message["content"], str) and message["role"] == "assistant", reply
        (client,) = [b for b in blocks("python") if "OpenAI(" in b]
        printed = subprocess.run([sys.executable, "-c", client.replace(":8000", f":{port}")],
                                 capture_output=True, text=True, timeout=120)
        assert printed.returncode == 0 and printed.stdout.strip(), printed.stderr[-2000:]
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, process.stdout.read()


def test_the_python_api_runs_as_shown(home):
    (api,) = [b for b in blocks("python") if "Generator.from_engine" in b]
    result = run(f"python -c {shlex.quote(api)}", home)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"\] (length|stop) ", result.stdout), result.stdout   # the scheduler's request
