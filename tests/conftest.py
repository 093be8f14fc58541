"""Shared fixtures: tiny checkpoints in the real on-disk layouts and engines built from them, made
once per test run (``pytest -n``'s workers share them)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from filelock import FileLock

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one core per worker (scripts/test.sh runs one per core): two workers' thread pools on the same
    # cores would spin against each other
    torch.set_num_threads(1)
if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors in interpreter mode; set before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from export.onnx_export import BuildLimits
from modeling.fixtures.tiny import TinySpec, make_tiny

ROOT = Path(__file__).resolve().parents[1]
TINY_FIELDS = {field.name for field in dataclasses.fields(TinySpec)}

# what test engines are built for: each distinct build is ~30 s of export on one core, so a module
# builds with these unless its test is about the limits (``engine_dir`` builds each engine once)
LIMITS = BuildLimits(max_batch=4, max_seq_len=96, max_prompt_chunk=8)
# the command-line tests' (room for a sentence as a prompt; 2 sequences at a time) and the servers'
# that take long requests (README's chat, Ray Serve)
CLI_LIMITS = BuildLimits(max_batch=2, max_seq_len=128, max_prompt_chunk=32)
LONG_LIMITS = BuildLimits(max_batch=4, max_seq_len=512, max_prompt_chunk=8)

GOLDEN = Path(__file__).resolve().parent / "data" / "golden" / "dspark-tiny"
GEMMA4_GOLDEN = GOLDEN.with_name("dspark-gemma4-tiny")

# ragged token-id prompts (lengths 7, 3, 11) used across the invariant tests
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]
# two tiny pairs that between them cover both architectures, both draft formats, both layouts
# and a reduced draft vocabulary: the cases every exported-engine test runs on
ENGINE_CASES = {
    "qwen3-native": dict(arch="qwen3"),
    "llama-speculators-reduced-bonus-anchor": dict(arch="llama", draft_format="speculators",
                                                    draft_vocab=30, layout="bonus-anchor"),
}
# a draft over its base logits' top 6 (build --markov-top-k), with a reduced vocabulary and the drafts'
# rows starting at block row 1: engine_dir(LIMITS, **MARKOV_TOP_K)
MARKOV_TOP_K = dict(ENGINE_CASES["llama-speculators-reduced-bonus-anchor"], markov_top_k=6)


def made_once(tmp_path_factory, key, make) -> list[str]:
    """What ``make(folder)`` returned (a list of paths) for ``key`` in this test run: the first
    worker to ask makes it in a folder of the run's temporary directory, which every ``pytest -n``
    worker shares, and the others wait for it and read it back (a build takes ~15 s of CPU)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent       # the run's, above each worker's own
    folder = root / "made" / hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    done = folder.with_suffix(".json")
    folder.parent.mkdir(exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)     # a worker's make that failed
            folder.mkdir()
            done.write_text(json.dumps([str(p) for p in make(folder)]))
    return json.loads(done.read_text())


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``tiny(**TinySpec fields) -> (target_dir, draft_dir)``, each pair written once."""

    def make(**fields) -> tuple[Path, Path]:
        spec = TinySpec(**fields)
        target_dir, draft_dir = made_once(tmp_path_factory, spec, lambda folder: make_tiny(folder, spec))
        return Path(target_dir), Path(draft_dir)

    return make


@pytest.fixture(scope="session")
def engine_dir(tiny, tmp_path_factory):
    """``engine_dir(limits, **given) -> path`` of an engine directory built once: ``given`` holds
    ``TinySpec`` fields (the pair) and ``build`` options (``markov_top_k``, ``dtype``,
    ``weights``, ``quantize_draft``, ...). Read-only: a test that changes an engine copies it."""
    from export.build import build

    def make(limits, **given) -> Path:
        fields = {name: value for name, value in given.items() if name in TINY_FIELDS}
        options = {name: value for name, value in given.items() if name not in TINY_FIELDS}

        def built(out: Path) -> list[Path]:
            target_dir, draft_dir = tiny(**fields)
            build(str(target_dir), str(draft_dir), out, limits=limits, progress=False, **options)
            return [out]

        key = (limits, sorted(options.items()), TinySpec(**fields))
        return Path(made_once(tmp_path_factory, key, built)[0])

    return make


def hf_greedy(target_dir: Path, prompts: list[list[int]], max_new_tokens: int, eos: int | None = 1):
    """``transformers`` ``generate`` greedy continuations, one prompt at a time (no padding), of a
    checkpoint folder or a GGUF file."""
    from transformers import AutoModelForCausalLM

    from modeling.checkpoint import hf_location

    location, options = hf_location(Path(target_dir))   # a folder, or a .gguf file
    model = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32, **options).eval()
    outputs = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
        outputs.append(ids[0, len(prompt):].tolist())
    return outputs


# the tiny server's queue: with the engine's 4 slots, 8 concurrent requests fit and 24 do not
SERVE_MAX_QUEUE = 4


@pytest.fixture(scope="session")
def tiny_server(engine_dir):
    """``(url, engine)``: ``python -m runtime.serve`` on the tiny qwen3 engine, model name ``tiny``,
    for every test that drives a server with a client; it must exit 0 on SIGTERM at the end."""
    engine = engine_dir(LIMITS, arch="qwen3")
    port = free_port()
    k = json.loads((engine / "manifest.json").read_text())["draft"]["k"]
    # every draft at every load: the tiny random draft would measure as not worth verifying
    process = subprocess.Popen([sys.executable, "-m", "runtime.serve", "--engine", str(engine),
                                "--port", str(port), "--model", "tiny", "--threads", "1",
                                "--max-queue", str(SERVE_MAX_QUEUE), "--draft-schedule", str(k)],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(process, f"{url}/health", 120)
    yield url, engine
    process.terminate()      # SIGTERM: a clean exit
    assert process.wait(timeout=30) == 0, process.stdout.read()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a server a test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(process, url: str, seconds: float) -> None:
    """Until ``url`` answers 200; a server that exits or takes longer than ``seconds`` fails the
    test with its output (``process``' stdout, text)."""
    deadline = time.time() + seconds
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):   # a busy machine: slow to answer
            if process.poll() is not None or time.time() > deadline:
                process.kill()
                pytest.fail(f"the server did not start:\n{process.stdout.read()}")
            time.sleep(0.3)


def median_confidence(pair, prompts: list[list[int]], max_new_tokens: int, temperature: float) -> float:
    """The median top probability of the draft's distributions over a generation: as a
    ``confidence_threshold`` it cuts about half the drafts, so sequences propose different counts."""
    from runtime.backends.pytorch import TorchBackend
    from runtime.decoding.batch import generate

    confidences = []

    class Probe(TorchBackend):
        def draft_step(self, *inputs, **options):
            tokens, q = super().draft_step(*inputs, **options)
            confidences.append(q.amax(-1).flatten())
            return tokens, q

    capacity = max(map(len, prompts)) + max_new_tokens + pair[1].config.block_size + 1
    generate(Probe(*pair, capacity=capacity), prompts, max_new_tokens=max_new_tokens,
             temperature=temperature, seed=2)
    return float(torch.cat(confidences).median())


# fixtures that build an engine or start a server: a test that uses one is in the real-model tier
SLOW_FIXTURES = {"engine_dir", "tiny_server"}
# the modules that take longest (minutes on one core; `scripts/test.sh` prints the slowest tests),
# run first: `pytest -n` hands each module whole to the next free worker, in this order, and a long
# one handed out last keeps one worker going while the others wait
LONGEST_FIRST = ("graphs/test_gguf.py", "families/test_hybrid.py", "families/test_gemma4.py",
                 "graphs/test_build_variants.py")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped where there is no CUDA GPU. The real-model tier is marked
    ``slow``: the modules and tests that say so, and every test that uses ``SLOW_FIXTURES``;
    ``pytest -m "not slow"`` runs the rest, the fast tier (the loop's logic, the scheduler, the
    policy, parsing and errors, on PyTorch modules of tiny checkpoints). ``LONGEST_FIRST``'s
    modules come first."""
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)

    def rank(item) -> int:
        path = item.path.as_posix()
        return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith(f"/tests/{name}")),
                    len(LONGEST_FIRST))

    items.sort(key=rank)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield
