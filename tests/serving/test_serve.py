"""``python -m runtime.serve`` on 127.0.0.1, driven by the official ``openai`` client: what it
answers equals what ``Generator`` generates, streamed or not, alone or among concurrent
requests; stop strings end the text before them; bad requests get OpenAI error objects and the
server goes on serving."""
from __future__ import annotations

import json
import re
import signal
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

from conftest import LIMITS, SERVE_MAX_QUEUE, free_port, wait_until_serving

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

ROOT = Path(__file__).resolve().parents[2]
MAX_QUEUE = SERVE_MAX_QUEUE
PROMPTS = ["abc def", "hello", "the quick brown fox", "zz", "a b c d e f g", "xyz"]


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


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


@pytest.mark.parametrize("speculative", [False, True])
def test_with_no_verify_step_tau_and_the_acceptance_are_null(client, server, speculative):
    """tau is tokens per verify step: with none (speculation off, or one token), null, not 0, and
    the acceptance per position null too (it was [] off and k zeros on); with verify steps, a
    number and k fractions."""
    def spec(max_tokens, on):
        reply = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=max_tokens,
                                          temperature=0, extra_body={"speculative": on})
        return reply.model_extra["speculative"]
    assert spec(1, speculative) == {"tau": None, "accepted_per_position": None, "verify_steps": 0}
    if speculative:
        measured = spec(20, True)
        assert measured["verify_steps"] > 0 and measured["tau"] >= 1
        k = json.loads((Path(server[1]) / "manifest.json").read_text())["draft"]["k"]
        assert len(measured["accepted_per_position"]) == k


def test_a_seeded_sampled_request_is_reproducible_at_any_load(client):
    """The same text alone, as one of four concurrent copies (which change how many drafts each
    step verifies) and without speculation: the target's own sample for the seed; another seed
    gives another."""
    def ask(seed, speculative=True):
        return client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=25, temperature=0.7,
                                         top_p=0.9, seed=seed,
                                         extra_body={"speculative": speculative}).choices[0].text

    alone = ask(11)
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, [11] * 4)) == [alone] * 4
    assert ask(11, speculative=False) == alone != ask(12)


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
    (dict(max_tokens=90), 400, "'prompt' has 3 tokens: with 'max_tokens' 90 it needs .* KV-cache rows"),
    (dict(max_completion_tokens=0), 400, "'max_completion_tokens': 0; expected an integer of at least 1"),
    (dict(top_k=-2), 400, "'top_k': -2; expected -1 or 0"),
    (dict(min_p=1.5), 400, "'min_p': 1.5; expected 0 .. 1"),
    (dict(presence_penalty=3), 400, "'presence_penalty': 3; expected -2 .. 2"),
    (dict(logprobs=21), 400, "'logprobs': 21; expected an integer 0 .. 20"),
    (dict(n=0), 400, "'n': 0; expected at least 1"),
    (dict(prompt=[3, 10**6]), 400, "'prompt': token ids must lie in 0 .."),
    (dict(max_tokens="ten"), 400, "'max_tokens': 'ten' is not an integer of at least 1"),
    (dict(model="other"), 404, "model 'other' does not exist"),
    (dict(temperature=3), 400, "'temperature': 3; expected 0 .. 2"),
    (dict(prompt="q" * 200), 400, "needs .* KV-cache rows; the capacity is 96"),
    (dict(prompt=""), 400, "'prompt': expected a non-empty string"),
])
def test_a_bad_request_gets_an_error_object_and_the_server_goes_on(client, request_, status, message):
    body = dict(model="tiny", prompt="abc", max_tokens=5) | request_
    extra = {name: body.pop(name) for name in ("top_k", "min_p", "max_completion_tokens")   # not in create()
             if name in body}
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**body, extra_body=extra)
    assert err.value.status_code == status
    assert err.value.body["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert re.search(message, err.value.body["message"]), err.value.body
    # the error names the request's own field
    named = next(iter(request_))
    assert err.value.body["param"] == ("prompt" if named in ("prompt",) else named), err.value.body
    assert client.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0).choices


@pytest.mark.parametrize("messages, param, message", [
    ([{"role": "wizard", "content": "hi"}], "messages.[0].role",
     "'wizard'; expected one of system, developer"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages.[0].content.[0]", "a 'image_url' part; expected a text part"),
    ([{"role": "user", "content": 5}], "messages.[0].content", "expected a string or a non-empty list"),
    ([], "messages", "expected a non-empty list of messages"),
])
def test_a_bad_message_is_named(client, messages, param, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    assert err.value.body["param"] == param
    assert message in err.value.body["message"], err.value.body


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi \ud800 there"}]}',
     "messages.[0].content"),
    ("/v1/completions", r'{"prompt": "hi \udfff"}', "prompt"),
    ("/v1/completions", r'{"prompt": "hi", "stop": ["\ud800"]}', "stop.[0]"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(server, path, raw, param):
    """JSON may escape a lone surrogate, which is no text (nothing encodes it as UTF-8): a 400 error
    object naming the field, where it was a plain-text 500 and a traceback; the server goes on."""
    request = urllib.request.Request(f"{server[0]}{path}", data=raw.encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 400
    body = json.loads(err.value.read())["error"]
    assert body["param"] == param and "lone surrogate" in body["message"], body
    assert urllib.request.urlopen(f"{server[0]}/health", timeout=10).status == 200


def test_tools_are_refused_not_ignored(client):
    """There is no tool calling: a request asking for it is a 400, not a reply that ignores it."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, tools=[tool])
    assert err.value.body["param"] == "tools" and "no tool calling" in err.value.body["message"]


def test_content_parts_and_developer_messages_read_as_strings_and_system(client):
    """OpenAI's list of text parts is the string of its texts joined by newlines (vLLM's reading),
    and a ``developer`` message is a ``system`` one."""
    def ask(messages):
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                              temperature=0).choices[0].message.content

    parts = [{"type": "text", "text": "abc"}, {"type": "text", "text": "def"}]
    assert ask([{"role": "user", "content": parts}]) == ask([{"role": "user", "content": "abc\ndef"}])
    assert (ask([{"role": "developer", "content": "be"}, {"role": "user", "content": "xyz"}])
            == ask([{"role": "system", "content": "be"}, {"role": "user", "content": "xyz"}]))


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405), ("DELETE", "/health", 405)])
def test_unknown_routes_and_methods_get_error_objects(server, method, path, status):
    request = urllib.request.Request(f"{server[0]}{path}", method=method)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == status
    body = json.loads(err.value.read())["error"]
    assert body["code"] == status and path in body["message"], body


def test_a_stream_has_one_id_and_created(client):
    for stream in (client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ab"}],
                                                  max_tokens=15, temperature=0, stream=True),
                   client.completions.create(model="tiny", prompt="ab", max_tokens=15, temperature=0,
                                             stream=True)):
        chunks = list(stream)
        assert len(chunks) > 3
        assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1


def test_without_a_seed_each_sample_is_fresh(client):
    texts = [client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=25,
                                       temperature=1.0).choices[0].text for _ in range(3)]
    assert len(set(texts)) > 1


def test_n_choices_are_the_requests_of_consecutive_seeds(client):
    def ask(seed, n):
        reply = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=1.0,
                                          seed=seed, n=n)
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    assert ask(7, 3) == ask(7, 1) + ask(8, 1) + ask(9, 1)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ab"}],
                                                 max_tokens=10, temperature=0, n=2, stream=True))
    ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(choice.index for choice in ends) == [0, 1]
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
             for i in (0, 1)]
    assert texts[0] == texts[1]   # greedy: both choices alike


def test_penalties_and_truncations_equal_the_generators(client, generator):
    """Per-request ``repetition_penalty`` and ``top_k`` (greedy stays the penalized argmax), as
    ``Generator`` computes them."""
    reply = client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=30, temperature=0,
                                      extra_body={"repetition_penalty": 1.5, "top_k": 5, "min_p": 0.1})
    expected = generator.generate(PROMPTS[4], max_new_tokens=30, chat_template=False, repetition_penalty=1.5)
    assert reply.choices[0].text == expected.texts[0]
    plain = generator.generate(PROMPTS[4], max_new_tokens=30, chat_template=False)
    assert expected.texts[0] != plain.texts[0]      # the penalty changed the text


def test_chat_logprobs_are_the_targets_with_speculation_or_without(client, generator):
    """Each token's log-probability and its top alternatives, the same bit for bit whether the
    token came from a verify row or a target-only step; greedy tokens are their rows' argmax."""
    def ask(speculative):
        messages = [{"role": "user", "content": PROMPTS[0]}]
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20,
                                               temperature=0, logprobs=True, top_logprobs=3,
                                               extra_body={"speculative": speculative})
        return reply.choices[0], reply.model_extra["speculative"]["verify_steps"]

    (spec, steps), (alone, none) = ask(True), ask(False)
    assert steps > 0 and none == 0
    entries = spec.logprobs.content
    assert len(entries) == 20
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in alone.logprobs.content]
    for entry in entries:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert entry.logprob == entry.top_logprobs[0].logprob < 0
    specials = set(generator.tokenizer.all_special_tokens)   # in the tokens, not in the text
    assert "".join(e.token for e in entries if e.token not in specials) == spec.message.content


def test_echo_logprobs_are_transformers(client, server):
    """``echo`` with ``logprobs``: the prompt's tokens' log-probabilities (none for its first) and
    the generated one's, as ``transformers`` computes them on the target of the float engine."""
    import torch
    from transformers import AutoModelForCausalLM

    from runtime import Generator

    ids = Generator.from_engine(server[1]).encode(PROMPTS[2], chat_template=False)
    reply = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=2,
                                      echo=True)
    scored = reply.choices[0].logprobs
    assert len(scored.token_logprobs) == len(ids) + 1 and scored.token_logprobs[0] is None
    assert scored.top_logprobs[0] is None and reply.choices[0].text.startswith(PROMPTS[2])
    target = json.loads((server[1] / "manifest.json").read_text())["source"]["target"]["path"]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    generated = reply.choices[0].logprobs.tokens[-1]
    full = ids + Generator.from_engine(server[1]).tokenizer.encode(generated, add_special_tokens=False)
    expected = torch.log_softmax(model(torch.tensor([full])).logits[0, :-1].float(), -1)
    expected = expected.gather(-1, torch.tensor(full[1:])[:, None])[:, 0].tolist()
    assert scored.token_logprobs[1:] == pytest.approx(expected, abs=2e-4)


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
    from runtime.decoding.draft_schedule import LoadSchedule
    from runtime.serving.openai_server import Server

    engine = engine_dir(LIMITS, arch="qwen3")
    release, failures = threading.Event(), []

    def load():
        release.wait(60)
        return Generator.from_engine(engine)

    server = Server(load, "tiny", MAX_QUEUE, LoadSchedule.constant(0))
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


@pytest.mark.parametrize("flag", ["--draft-schedule", "--port"])
def test_a_bad_flag_is_one_line_before_loading(engine_dir, flag):
    """A bad schedule, and a port out of range (it printed that address, then listened on another)."""
    engine = engine_dir(LIMITS, arch="qwen3")
    value = {"--draft-schedule": "1:3,1:0", "--port": "99999"}[flag]
    done = subprocess.run([sys.executable, "-m", "runtime.serve", "--engine", str(engine), flag, value],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    k = json.loads((engine / "manifest.json").read_text())["draft"]["k"]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith({
        "--draft-schedule": f"error: --draft-schedule '1:3,1:0': expected adaptive, or BUSY:DRAFTS pairs "
                            f"with BUSY rising from 1 and DRAFTS 0 .. {k} (the engine's k)",
        "--port": "error: --port 99999: expected a port number, 0 .. 65535"}[flag]), line


def test_a_huge_body_is_refused_at_once_and_a_big_one_stalls_no_one(server):
    """A body over ``--max-body`` (16 MB) is refused with 413 from its ``Content-Length``, before it
    is sent; a big one under it is read and tokenized off the event loop, so ``/health`` answers
    at once meanwhile."""
    port = int(server[0].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % (17 << 20))
        raw.settimeout(30)
        answer = b""
        while b"(--max-body)" not in answer and (data := raw.recv(65536)):
            answer += data
    assert answer.startswith(b"HTTP/1.1 413") and b"(--max-body)" in answer, answer
    big = json.dumps({"model": "tiny", "prompt": "ab " * (1 << 20), "max_tokens": 3}).encode()
    outcome = {}

    def send():
        request = urllib.request.Request(f"{server[0]}/v1/completions", data=big,
                                         headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=120)
        except urllib.error.HTTPError as err:
            outcome["status"], outcome["body"] = err.code, json.loads(err.read())
    sender = threading.Thread(target=send)
    sender.start()
    waits = []
    while sender.is_alive() and len(waits) < 20:
        begin = time.perf_counter()
        urllib.request.urlopen(f"{server[0]}/health", timeout=30)
        waits.append(time.perf_counter() - begin)
        time.sleep(0.1)
    sender.join(120)
    assert outcome["status"] == 400 and "KV-cache rows" in outcome["body"]["error"]["message"]
    assert len(waits) >= 3 and max(waits) < 1.0, waits


def _post(port: int, body: dict) -> tuple[int, str]:
    """A raw POST to /v1/completions: its status and whole body, or (0, the error) if the
    connection broke."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read().decode()
    except (OSError, http.client.HTTPException) as err:
        return 0, repr(err)


def test_a_stop_under_load_ends_every_request_well_and_exits_0(engine_dir):
    """SIGINT with 8 long requests in flight, half streamed, and a grace period of 0: every client
    gets a well-formed end (a whole reply, a 503 error object, or a stream whose open choice ends
    with finish reason ``abort``, an error event and ``[DONE]``) and the server exits 0 without a
    traceback; it said where it listened, that it was stopping, and logged each request
    (``--access-log``)."""
    engine = engine_dir(LIMITS, arch="qwen3")
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "runtime.serve", "--engine", str(engine), "--port",
                                str(port), "--model", "tiny", "--threads", "1", "--draft-schedule", "0",
                                "--grace-period", "0", "--access-log"], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(process, f"{url}/health", 120)
    outcomes = [None] * 8

    def ask(i):
        outcomes[i] = (i % 2, *_post(port, {"prompt": "q", "max_tokens": 80, "temperature": 0,
                                            "stream": i % 2 == 1}))
    clients = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for client in clients:
        client.start()
    deadline = time.time() + 30
    while _metrics(url)["dspark:num_requests_running"] < LIMITS.max_batch and time.time() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    output = process.communicate(timeout=60)[0]
    for client in clients:
        client.join(60)
    assert process.returncode == 0 and "Traceback" not in output, output
    assert f"on http://127.0.0.1:{port}" in output and '"POST /v1/completions HTTP/1.1"' in output
    assert "stopping: running requests have 0 s (--grace-period) to finish, then end with 503" in output
    cut = 0
    for streamed, status, body in outcomes:
        if status == 503:
            assert json.loads(body)["error"]["message"] == "the server is shutting down"
            cut += 1
        elif streamed:
            assert status == 200 and body.endswith("data: [DONE]\n\n"), body[-300:]
            events = [json.loads(line[6:]) for line in body.split("\n\n") if line.startswith("data: {")]
            reasons = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
            assert reasons[-1] in ("abort", "length", "stop") and None not in reasons[-1:]
            if reasons[-1] == "abort":
                assert events[-1]["error"]["code"] == 503
                cut += 1
        else:
            assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] in ("length", "stop")
    assert cut >= 4


def test_a_conversations_next_turn_reuses_its_slot(client, generator):
    """The second turn of a conversation prefills only what follows the first turn's sequence,
    still in its slot (``usage.prompt_tokens_details.cached_tokens``), and answers what
    ``Generator`` answers from scratch."""
    messages = [{"role": "system", "content": "abc def ghi"}, {"role": "user", "content": PROMPTS[2]}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "xyz"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens < cached < second.usage.prompt_tokens
    assert second.choices[0].message.content == generator.collect(
        [_run(generator.conversation(messages, max_new_tokens=10))]).texts[0]


def _run(decoding):
    for _ in decoding:
        pass
    return decoding


def test_the_models_generation_config_sets_the_sampling_defaults(server, tmp_path):
    """An engine's ``generation_config.json`` (the target's, copied by the build) gives a request
    the fields it leaves out, as vLLM's ``--generation-config auto``; without one, vLLM's defaults
    (temperature 1) and a fresh seed per request."""
    import shutil

    from runtime import Generator
    from runtime.serving.openai_request import Prompt, request_params

    target = json.loads((server[1] / "manifest.json").read_text())["source"]["target"]["path"]
    copied = (server[1] / "generation_config.json").read_text()   # the build's copy
    assert copied == (Path(target) / "generation_config.json").read_text()
    engine = shutil.copytree(server[1], tmp_path / "engine")
    (engine / "generation_config.json").unlink()
    plain = Generator.from_engine(engine)
    (engine / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "bos_token_id": 0}))
    configured = Generator.from_engine(engine)
    assert configured.sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    prompt = Prompt([5, 6, 7], "abc", "prompt")

    def params(generator, **body):
        return request_params(body, prompt, generator, False, generator.sampling_defaults)

    defaults = params(configured)
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.6, 20, 0.95)
    assert params(configured, temperature=0, top_k=-1).temperature == params(configured, top_k=-1).top_k == 0
    assert (params(plain).temperature, params(plain).top_k) == (1.0, 0)
    assert params(plain).seed != params(plain).seed and params(plain, seed=3).seed == 3


def test_a_streamed_completion_echoes_and_scores_as_a_whole_one(client):
    """Streamed with ``echo`` and ``logprobs``: its texts and per-token log-probabilities, joined,
    are the whole reply's (the prompt's first, its first token unscored)."""
    body = dict(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**body).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [c.logprobs for c in chunks if c.logprobs]
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((getattr(s, name) for s in streamed), []) == getattr(whole.logprobs, name), name
