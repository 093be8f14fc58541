"""An engine directory served by Triton Inference Server for real, both ways: a model repository
that ``python -m export triton-repo`` writes, served by the ``tritonserver`` binary of
``nvidia-pytriton`` (``scripts/setup_triton.sh``, ``scripts/tritonserver.sh``), and the PyTriton
binding (``runtime.serving.pytriton_binding.serve``); each on 127.0.0.1, where Triton's own
endpoints answer what
``Generator`` generates: the generate extension over HTTP, streamed or not, and gRPC streaming
through ``tritonclient``."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import LIMITS, free_port, wait_until_serving

ROOT = Path(__file__).resolve().parents[2]
TRITON_PYTHON = ROOT / ".venv-triton" / "bin" / "python"
PROMPTS = ["abc def", "hello", "the quick brown fox", "zz"]
MAX_TOKENS = 24

pytestmark = [pytest.mark.slow,   # runs servers: the real-model tier
              pytest.mark.skipif(not TRITON_PYTHON.exists(), reason="no .venv-triton (Triton Inference "
                                                                    "Server): run scripts/setup_triton.sh")]


PYTRITON = """
import faulthandler, signal, sys
from pytriton.triton import TritonConfig
from runtime.serving.pytriton_binding import serve

engine, http, grpc, metrics, k = sys.argv[1:]
faulthandler.register(signal.SIGUSR1)   # every thread's stack, for a test that finds it hung
serve(engine, TritonConfig(http_address="127.0.0.1", http_port=int(http), grpc_address="127.0.0.1",
                           grpc_port=int(grpc), metrics_address="127.0.0.1", metrics_port=int(metrics),
                           allow_gpu_metrics=False, exit_on_error=True),
      name="tiny", threads=1, draft_schedule=k)
"""


@pytest.fixture(scope="module", params=["repository", "pytriton"])
def triton(request, engine_dir, tmp_path_factory):
    """Triton serving the engine as model ``tiny``: from a model repository, or bound by PyTriton
    (which stops on SIGINT)."""
    engine = engine_dir(LIMITS, arch="qwen3")
    k = json.loads((engine / "manifest.json").read_text())["draft"]["k"]
    http, grpc, metrics = free_port(), free_port(), free_port()
    if request.param == "repository":
        repository = tmp_path_factory.mktemp("models")
        subprocess.run([sys.executable, "-m", "export", "triton-repo", str(engine), str(repository),
                        "--name", "tiny", "--threads", "1", "--draft-schedule", str(k)], cwd=ROOT, check=True)
        command = ["bash", "scripts/tritonserver.sh", "--model-repository", str(repository),
                   "--http-address", "127.0.0.1", "--http-port", str(http),
                   "--grpc-address", "127.0.0.1", "--grpc-port", str(grpc),
                   "--metrics-address", "127.0.0.1", "--metrics-port", str(metrics),
                   "--allow-gpu-metrics", "false", "--exit-on-error", "true",
                   "--pinned-memory-pool-byte-size", "0"]
    else:
        command = [str(TRITON_PYTHON), "-c", PYTRITON, str(engine), *map(str, (http, grpc, metrics, k))]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{http}"
    wait_until_serving(process, f"{url}/v2/models/tiny/ready", 180)
    # Triton logs every request: a pipe nobody reads fills (64 KB) and blocks the server mid-write,
    # which hung its exit once; its last lines are kept for a failure's message
    output = deque(maxlen=200)
    threading.Thread(target=output.extend, args=(process.stdout,), daemon=True).start()
    yield {"http": url, "grpc": f"127.0.0.1:{grpc}", "metrics": f"http://127.0.0.1:{metrics}/metrics",
           "engine": engine, "kind": request.param}
    process.send_signal(signal.SIGTERM if request.param == "repository" else signal.SIGINT)
    try:
        assert process.wait(timeout=60) == 0, "".join(output)
    except subprocess.TimeoutExpired:
        if request.param == "pytriton":
            process.send_signal(signal.SIGUSR1)   # its threads' stacks into the output
            time.sleep(2)
        process.kill()
        pytest.fail(f"Triton did not exit within 60 s of the signal:\n{''.join(output)}")


@pytest.fixture(scope="module")
def expected(triton):
    from runtime import Generator

    return Generator.from_engine(triton["engine"]).generate(PROMPTS, chat_template=False,
                                                            max_new_tokens=MAX_TOKENS).texts


def _post(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _stream(triton, prompt: str) -> list[dict]:
    status, body = _post(f"{triton['http']}/v2/models/tiny/generate_stream",
                         {"text_input": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True})
    assert status == 200, body
    return [json.loads(line[len(b"data: "):]) for line in body.splitlines() if line.startswith(b"data: ")]


def test_generate_and_generate_stream_equal_the_generator(triton, expected):
    status, body = _post(f"{triton['http']}/v2/models/tiny/generate",
                         {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0})
    reply = json.loads(body)
    assert status == 200 and reply["text_output"] == expected[0], reply
    assert reply["finish_reason"] in ("stop", "length") and 0 < reply["completion_tokens"] <= MAX_TOKENS
    events = _stream(triton, PROMPTS[0])
    assert len(events) > 2 and "".join(e["text_output"] for e in events) == expected[0]
    assert [e["finish_reason"] for e in events[:-1]] == [""] * (len(events) - 1)
    assert events[-1]["finish_reason"] == reply["finish_reason"]
    assert events[-1]["completion_tokens"] == reply["completion_tokens"]


def test_four_concurrent_streams_get_their_single_request_output(triton, expected):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        streams = list(pool.map(lambda p: _stream(triton, p), PROMPTS))
    assert ["".join(e["text_output"] for e in events) for events in streams] == expected


# the client ends with os._exit: tritonclient's stream thread is not a daemon, so a process whose
# stream is not stopped (an error, a missing response) would otherwise hang past the test's timeout
# instead of saying what went wrong
GRPC_CLIENT = """
import json, os, queue, sys
import numpy as np
import tritonclient.grpc as grpc

url, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
results = queue.Queue()
client = grpc.InferenceServerClient(url)
client.start_stream(callback=lambda result, error: results.put((result, error)))
inputs = [grpc.InferInput("text_input", [1], "BYTES"), grpc.InferInput("max_tokens", [1], "INT32"),
          grpc.InferInput("temperature", [1], "FP32"), grpc.InferInput("stream", [1], "BOOL")]
values = [np.array([prompt.encode()], dtype=np.object_), np.array([max_tokens], np.int32),
          np.array([0.0], np.float32), np.array([True])]
for tensor, value in zip(inputs, values):
    tensor.set_data_from_numpy(value)
client.async_stream_infer("tiny", inputs, enable_empty_final_response=True)
pieces = []
try:
    while True:
        result, error = results.get(timeout=60)
        if error is not None:
            raise RuntimeError(error)
        response = result.get_response()
        if response.outputs:
            pieces.append([result.as_numpy(name)[0].decode() for name in ("text_output", "finish_reason")])
        if response.parameters["triton_final_response"].bool_param:
            break
except Exception as err:
    print(f"error after {len(pieces)} responses: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    os._exit(1)
print(json.dumps(pieces), flush=True)
os._exit(0)
"""


def test_grpc_streaming_through_tritonclient(triton, expected):
    """``tritonclient``'s gRPC stream, run in the Triton environment (it pins a protobuf of its own)."""
    run = subprocess.run([str(TRITON_PYTHON), "-c", GRPC_CLIENT, triton["grpc"], PROMPTS[2],
                          str(MAX_TOKENS)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    pieces = json.loads(run.stdout)
    assert len(pieces) > 2 and "".join(text for text, _ in pieces) == expected[2]
    assert pieces[-1][1] in ("stop", "length")


@pytest.mark.parametrize("body, message", [
    ({"max_tokens": 4}, "'text_input': expected a non-empty string"),
    ({"text_input": "abc", "max_tokens": 0}, "'max_tokens': 0; expected an integer of at least 1"),
    ({"text_input": "abc", "temperature": 3.0}, "'temperature': 3.0; expected 0 .. 2"),
    ({"text_input": "abc" * 40, "max_tokens": 8}, "has 120 tokens"),
])
def test_a_bad_request_gets_tritons_error_and_the_server_goes_on(triton, expected, body, message):
    status, reply = _post(f"{triton['http']}/v2/models/tiny/generate", body)
    error = json.loads(reply)["error"]
    assert status == 400 and message in error and "\n" not in error.strip(), reply
    status, reply = _post(f"{triton['http']}/v2/models/tiny/generate",
                          {"text_input": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200 and json.loads(reply)["text_output"] == expected[1]


def _metrics(triton) -> dict[str, float]:
    """Triton's ``/metrics`` for model ``tiny``: each series summed over its other labels."""
    text = urllib.request.urlopen(triton["metrics"], timeout=10).read().decode()
    sums: dict[str, float] = {}
    for name, labels, value in re.findall(r"^([\w:]+)\{(.*)\} (\S+)$", text, re.MULTILINE):
        if 'model="tiny"' in labels:
            sums[name] = sums.get(name, 0.0) + float(value)
    return sums


def _ours(metrics: dict[str, float]) -> dict[str, float]:
    return {name: value for name, value in metrics.items() if name.startswith("dspark:")}


def _ours_settled(triton) -> dict[str, float]:
    """The metrics once ours (copied into Triton every second) have stopped changing."""
    deadline, metrics = time.time() + 30, _metrics(triton)
    while time.time() < deadline:
        time.sleep(1.5)
        metrics, last = _metrics(triton), metrics
        if _ours(metrics) == _ours(last):
            break
    return metrics


def _ours_counted(triton, requests: float) -> dict[str, float]:
    """The metrics once ours count ``requests`` ended requests."""
    deadline = time.time() + 30
    while (metrics := _metrics(triton)).get("dspark:request_success_total") != requests \
            and time.time() < deadline:
        time.sleep(0.2)
    return metrics


def test_tritons_model_ready_and_metrics_count_the_requests(triton):
    """Triton's own metrics count requests; the model repository's model adds ours, which count
    what the reply says (PyTriton's model runs outside Triton: only Triton's)."""
    assert urllib.request.urlopen(f"{triton['http']}/v2/models/tiny/ready", timeout=10).status == 200
    status, reply = _post(f"{triton['http']}/v2/models/tiny/generate",
                          {"text_input": PROMPTS[3], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200
    if triton["kind"] == "pytriton":
        assert _metrics(triton)["nv_inference_request_success"] >= 1
        return
    before = _ours_settled(triton)
    status, reply = _post(f"{triton['http']}/v2/models/tiny/generate",
                          {"text_input": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0})
    after = _ours_counted(triton, before["dspark:request_success_total"] + 1)
    assert status == 200
    assert after["dspark:request_success_total"] == before["dspark:request_success_total"] + 1
    assert after["nv_inference_request_success"] == before["nv_inference_request_success"] + 1
    grew = {name: after[name] - value for name, value in _ours(before).items()}
    assert grew["dspark:generation_tokens_total"] == json.loads(reply)["completion_tokens"]
    assert grew["dspark:prompt_tokens_total"] > 0 and grew["dspark:spec_decode_num_drafts_total"] > 0
    assert 0 <= grew["dspark:spec_decode_num_accepted_tokens_total"] \
        <= grew["dspark:spec_decode_num_draft_tokens_total"]
    assert after["dspark:num_requests_running"] == after["dspark:num_requests_waiting"] == 0
