"""``python -m runtime.serve`` on 127.0.0.1, driven by the official ``openai`` client: what it
answers equals what ``Generator`` generates, streamed or not, alone or among concurrent
requests; stop strings end the text before them; bad requests get OpenAI error objects and the
server goes on serving."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from export.onnx_export import Limits

from conftest import free_port, wait_until_serving

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

ROOT = Path(__file__).resolve().parents[1]
LIMITS = Limits(max_batch=4, max_seq_len=96, max_prompt_chunk=8)  # test_ort_backend's: built once
MAX_QUEUE = 4     # with the 4 slots, the 8 concurrent requests below fit and 24 do not
PROMPTS = ["abc def", "hello", "the quick brown fox", "zz", "a b c d e f g", "xyz"]


@pytest.fixture(scope="module")
def server(engine_dir):
    engine = engine_dir(LIMITS, arch="qwen3")
    port = free_port()
    k = json.loads((engine / "manifest.json").read_text())["draft"]["k"]
    # every draft at every load: the tiny random draft would measure as not worth verifying
    process = subprocess.Popen([sys.executable, "-m", "runtime.serve", "--engine", str(engine),
                                "--port", str(port), "--model", "tiny", "--threads", "1",
                                "--max-queue", str(MAX_QUEUE), "--draft-schedule", str(k)],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(process, f"{url}/health", 120)
    yield url, engine
    process.terminate()      # SIGTERM: a clean exit
    assert process.wait(timeout=30) == 0, process.stdout.read()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def generator(server):
    from runtime import Generator

    return Generator.from_engine(server[1])


def test_chat_and_completions_equal_the_generator(client, generator):
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                           max_tokens=20, temperature=0)
    expected = generator.generate(PROMPTS[0], max_new_tokens=20)
    assert reply.choices[0].message.content == expected.texts[0]
    assert reply.choices[0].finish_reason == ("stop" if len(expected.token_ids[0]) < 20 else "length")
    assert reply.usage.completion_tokens == len(expected.token_ids[0])
    assert reply.model_extra["speculative"]["verify_steps"] > 0
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=25, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    plain = generator.generate(PROMPTS[2], max_new_tokens=25, chat_template=False)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.texts[0]
    assert chunks[-1].usage.completion_tokens == len(plain.token_ids[0])
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_concurrent_requests_get_their_single_request_output(client, generator):
    """Eight clients at once, every other one with speculation off (``"speculative": false``)."""
    prompts = PROMPTS + PROMPTS[:2]

    def ask(i):
        messages = [{"role": "user", "content": prompts[i]}]
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0,
                                               extra_body={"speculative": i % 2 == 0})
        return reply.choices[0].message.content, reply.model_extra["speculative"]["verify_steps"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, range(len(prompts))))
    assert [text for text, _ in together] == generator.generate(prompts, max_new_tokens=30).texts
    assert all((steps > 0) == (i % 2 == 0) for i, (_, steps) in enumerate(together))


def test_a_seeded_sampled_request_is_reproducible(client):
    def ask(seed):
        return client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=25, temperature=1.0,
                                         top_p=0.9, seed=seed).choices[0].text

    assert ask(3) == ask(3) != ask(4)


def test_a_stop_string_ends_the_text_streamed_or_not(client, generator):
    full = generator.generate(PROMPTS[1], max_new_tokens=30, chat_template=False).texts[0]
    stop = full[6:9]
    before = full[:full.index(stop)]
    reply = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=30, temperature=0,
                                      stop=stop)
    assert (reply.choices[0].text, reply.choices[0].finish_reason) == (before, "stop")
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=30, temperature=0,
                                            stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == before
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("request_, status, message", [
    (dict(max_tokens=0), 400, "'max_tokens': 0; expected an integer of at least 1"),
    (dict(max_tokens="ten"), 400, "'max_tokens': 'ten' is not an integer of at least 1"),
    (dict(model="other"), 404, "model 'other' does not exist"),
    (dict(temperature=3), 400, "'temperature': 3; expected 0 .. 2"),
    (dict(prompt="q" * 200), 400, "needs .* KV-cache rows; the capacity is 96"),
    (dict(prompt=""), 400, "'prompt': expected a non-empty string"),
])
def test_a_bad_request_gets_an_error_object_and_the_server_goes_on(client, request_, status, message):
    body = dict(model="tiny", prompt="abc", max_tokens=5) | request_
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**body)
    assert err.value.status_code == status
    assert err.value.body["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert re.search(message, err.value.body["message"]), err.value.body
    assert client.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0).choices


def test_malformed_json_is_a_400(server):
    request = urllib.request.Request(f"{server[0]}/v1/chat/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 400
    assert json.loads(err.value.read())["error"]["message"] == "the request body is not valid JSON"


def test_a_full_queue_answers_429_with_retry_after_at_once(client):
    """Twenty-four requests at once: four take the slots, four wait, and what arrives while
    both are full is refused with 429 and ``Retry-After``; every other request completes."""
    def ask(_):
        try:
            reply = client.completions.create(model="tiny", prompt="ab", max_tokens=80, temperature=0)
            return reply.choices[0].finish_reason
        except openai.RateLimitError as err:
            assert err.response.headers["retry-after"] == "1"
            return 429

    with ThreadPoolExecutor(24) as pool:
        outcomes = list(pool.map(ask, range(24)))
    assert 1 <= outcomes.count(429) <= 24 - LIMITS.max_batch - MAX_QUEUE
    assert all(o in ("stop", "length") for o in outcomes if o != 429)


def _metrics(url) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_metrics_count_what_was_served(client, server):
    before = _metrics(server[0])
    reply = client.completions.create(model="tiny", prompt="xyz", max_tokens=12, temperature=0)
    after = _metrics(server[0])
    gained = {name[len("dspark:"):]: after[name] - before.get(name, 0) for name in after}
    assert gained["generation_tokens_total"] == 12
    assert gained["prompt_tokens_total"] == reply.usage.prompt_tokens
    assert gained["spec_decode_num_drafts_total"] == reply.model_extra["speculative"]["verify_steps"] > 0
    assert after["dspark:num_requests_running"] == after["dspark:num_requests_waiting"] == 0
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                      "e2e_request_latency_seconds"):
        assert gained[f"{histogram}_count"] == 1, histogram
        assert gained[f'{histogram}_bucket{{le="+Inf"}}'] == 1
    assert 0 < gained["time_to_first_token_seconds_sum"] < gained["e2e_request_latency_seconds_sum"]
    steps = reply.model_extra["speculative"]["verify_steps"]
    assert gained["iteration_seconds_count"] >= steps + 1     # its prefill and its decode steps


def test_a_client_that_goes_away_frees_its_slot(client, server):
    """A stream closed after its first chunk is cancelled at the next step (its greedy output has
    no EOS for 80 tokens, so it would otherwise run on)."""
    cancelled = 'dspark:request_success_total{finished_reason="cancelled"}'
    before = _metrics(server[0]).get(cancelled, 0)
    stream = client.completions.create(model="tiny", prompt="q", max_tokens=80, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.time() + 20
    while (now := _metrics(server[0])).get(cancelled, 0) == before and time.time() < deadline:
        time.sleep(0.1)
    assert now.get(cancelled, 0) == before + 1 and now["dspark:num_requests_running"] == 0


def test_a_client_that_goes_away_before_a_whole_reply_frees_its_slot(server):
    """A non-streamed request whose client closes the connection right after sending it is
    cancelled (target-only, 80 tokens without EOS: it would run on for 80 steps)."""
    cancelled = 'dspark:request_success_total{finished_reason="cancelled"}'
    tokens = "dspark:generation_tokens_total"
    before = _metrics(server[0])
    body = json.dumps({"model": "tiny", "prompt": "q", "max_tokens": 80, "temperature": 0,
                       "speculative": False}).encode()
    port = int(server[0].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.time() + 20
    was = before.get(cancelled, 0)
    while (now := _metrics(server[0])).get(cancelled, 0) == was and time.time() < deadline:
        time.sleep(0.05)
    assert now.get(cancelled, 0) == was + 1 and now["dspark:num_requests_running"] == 0
    assert now[tokens] - before[tokens] < 80


def test_health_is_503_until_the_engine_has_loaded(engine_dir):
    """A server listens at once and loads on a thread of its own: until the engine is open,
    ``/health`` and requests answer 503 with ``Retry-After``; then it serves."""
    import uvicorn

    from runtime import Generator
    from runtime.draft_schedule import DraftSchedule
    from runtime.serve import Server

    engine = engine_dir(LIMITS, arch="qwen3")
    release, failures = threading.Event(), []

    def load():
        release.wait(60)
        return Generator.from_engine(engine)

    server = Server(load, "tiny", MAX_QUEUE, DraftSchedule.constant(0))
    port = free_port()
    http = uvicorn.Server(uvicorn.Config(server.app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    server.start_loading(failures.append)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    try:
        deadline = time.time() + 30
        while not http.started and time.time() < deadline:
            time.sleep(0.05)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{url}/health", timeout=10)
        assert (err.value.code, err.value.headers["Retry-After"]) == (503, "1")
        assert json.loads(err.value.read())["error"]["message"] == "the model is loading; retry shortly"
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="tiny", prompt="abc", max_tokens=3)
        assert refused.value.status_code == 503
        release.set()
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=10)
                break
            except urllib.error.HTTPError:
                time.sleep(0.1)
        reply = client.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0)
        assert reply.usage.completion_tokens == 3 and not failures
    finally:
        release.set()
        http.should_exit = True
        thread.join(30)


def test_a_bad_draft_schedule_is_one_line_before_loading(engine_dir):
    engine = engine_dir(LIMITS, arch="qwen3")
    done = subprocess.run([sys.executable, "-m", "runtime.serve", "--engine", str(engine),
                           "--draft-schedule", "1:3,1:0"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    k = json.loads((engine / "manifest.json").read_text())["draft"]["k"]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: --draft-schedule '1:3,1:0': expected BUSY:DRAFTS pairs with BUSY "
                           f"rising from 1 and DRAFTS 0 .. {k} (the engine's k)"), line
