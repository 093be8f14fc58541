"""``python -m runtime.ray_serve`` with 2 replicas on a local Ray cluster: requests reach both and
get what ``Generator`` gives them alone; beyond the slots and the queue Ray answers 503; a replica
killed mid-run is replaced, the requests it was serving fail cleanly and the other replica's
complete; a stop ends every replica's streams well-formed and exits 0."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import pytest

from conftest import LONG_LIMITS, free_port

pytestmark = pytest.mark.slow   # the real-model tier: builds engines or runs servers

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (the ray extra)")

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["abc def", "hello", "the quick brown fox", "zz", "a b c d e f g", "xyz", "mn", "qrs tuv"]
MAX_QUEUE = len(PROMPTS)   # the 8 requests a test sends at once never overflow the queue


@pytest.fixture(scope="module")
def cluster(engine_dir):
    engine = engine_dir(LONG_LIMITS, arch="qwen3")
    port = free_port()
    k = json.loads((engine / "manifest.json").read_text())["draft"]["k"]
    process = subprocess.Popen([sys.executable, "-m", "runtime.ray_serve", "--engine", str(engine),
                                "--replicas", "2", "--port", str(port), "--model", "tiny",
                                "--draft-schedule", str(k), "--max-queue", str(MAX_QUEUE),
                                "--grace-period", "0"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # ready once every replica is: the command says so after Ray Serve's deployment is running
    output, ready = [], threading.Event()

    def read():
        for line in process.stdout:
            output.append(line)
            if line.startswith("serving "):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout=240) or process.poll() is not None:
        process.kill()
        pytest.fail("Ray Serve did not start:\n" + "".join(output))
    url = f"http://127.0.0.1:{port}"
    yield url, engine, process, output
    process.send_signal(signal.SIGTERM)    # a second time after the stop test: nothing left to do
    assert process.wait(timeout=120) == 0


def _complete(url: str, prompt: str, max_tokens: int, stream: bool = False):
    """A greedy completion; streamed ones decode target-only, a token per step: slow enough to be
    killed mid-run."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "speculative": not stream}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=120)


def test_requests_reach_both_replicas_and_get_their_single_request_output(cluster):
    from runtime import Generator

    url, engine, *_ = cluster
    expected = Generator.from_engine(engine).generate(PROMPTS, chat_template=False, max_new_tokens=24).texts

    def ask(prompt):
        with _complete(url, prompt, 24) as reply:
            return json.loads(reply.read())["choices"][0]["text"], reply.headers["x-replica"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(ask, PROMPTS))
    assert [text for text, _ in replies] == expected
    assert len({replica for _, replica in replies}) == 2


def _long_streams(url: str, n: int) -> list:
    """``n`` long streams, each in a slot once its first chunk has come."""
    streams = [_complete(url, "q", 400, stream=True) for _ in range(n)]
    for stream in streams:
        stream.readline()
    return streams


def test_beyond_the_slots_and_the_queue_ray_answers_503_and_serves_the_queue(cluster):
    """With both replicas' 8 slots held by long streams, 9 more requests: the queue takes
    ``MAX_QUEUE`` of them and refuses the last with 503 at once; when the streams go, the queued
    ones are served."""
    url, *_ = cluster
    streams = _long_streams(url, 2 * LONG_LIMITS.max_batch)

    def status(prompt) -> int:
        try:
            with _complete(url, prompt, 8) as reply:
                return reply.status
        except urllib.error.HTTPError as err:
            return err.code

    with ThreadPoolExecutor(MAX_QUEUE + 1) as pool:
        asked = [pool.submit(status, prompt) for prompt in [*PROMPTS, "one too many"]]
        first = next(as_completed(asked)).result()
        for stream in streams:
            stream.close()
        codes = sorted(future.result() for future in asked)
    assert first == 503
    assert codes == [200] * MAX_QUEUE + [503]


def _replica_pid(header: str) -> int:
    return int(header.rsplit("pid ", 1)[1].rstrip(")"))


def test_a_killed_replica_is_replaced_and_only_its_requests_fail(cluster):
    """Eight long streams over both replicas; once each has its first chunk, one replica is killed:
    its streams break off, the other's run to their end."""
    url, *_ = cluster
    streams = _long_streams(url, len(PROMPTS))
    replicas = [stream.headers["x-replica"] for stream in streams]
    assert len(set(replicas)) == 2
    killed = replicas[0]
    os.kill(_replica_pid(killed), signal.SIGKILL)

    def finished(stream) -> bool:
        try:
            return stream.read().endswith(b"data: [DONE]\n\n")
        except (OSError, http.client.HTTPException):   # the connection broke mid-stream
            return False

    outcomes = [finished(stream) for stream in streams]
    assert outcomes == [replica != killed for replica in replicas]

    def served_by(_) -> str | None:
        try:
            with _complete(url, "hi", 4) as reply:
                return reply.headers["x-replica"]
        except urllib.error.HTTPError:   # routed to the dead replica before Ray noticed
            return None

    deadline = time.time() + 120
    while time.time() < deadline:   # Ray starts a replica in its place
        with ThreadPoolExecutor(4) as pool:
            serving = set(pool.map(served_by, range(8))) - {None}
        if len(serving) == 2 and killed not in serving:
            break
        time.sleep(1)
    assert len(serving) == 2 and killed not in serving


def test_a_stop_ends_every_replicas_streams_well_formed_and_exits_0(cluster):
    """SIGTERM with long streams in all 8 slots of both replicas (grace period 0): each stream
    ends well-formed before Ray Serve shuts down, those still running with finish reason ``abort``,
    a 503 error event and ``[DONE]`` (one that reached its end in the grace period as usual), and
    the command exits 0. Last in this file: the cluster is gone after it."""
    url, _, process, output = cluster
    streams = _long_streams(url, 2 * LONG_LIMITS.max_batch)
    assert len({stream.headers["x-replica"] for stream in streams}) == 2
    process.send_signal(signal.SIGTERM)
    aborted = 0
    for stream in streams:
        body = stream.read().decode()
        assert body.endswith("data: [DONE]\n\n"), body[-300:]
        events = [json.loads(line[6:]) for line in body.split("\n\n") if line.startswith("data: {")]
        reasons = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
        assert reasons[-1] in ("abort", "stop", "length"), body[-300:]
        if reasons[-1] == "abort":
            assert events[-1]["error"]["code"] == 503
            aborted += 1
    assert aborted >= 1
    assert process.wait(timeout=120) == 0
    said = "stopping: running requests have 0 s"
    deadline = time.monotonic() + 10   # the reader thread may not have read the last lines yet
    while not any(line.startswith(said) for line in output) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(line.startswith(said) for line in output), output
