"""Real clients, unmodified, against ``python -m runtime.serve`` on 127.0.0.1 (the tiny engine of
``conftest.tiny_server``): lm-eval's ``local-completions`` on a loglikelihood task (its
log-likelihoods equal what ``transformers`` computes on the float engine's target) and
``local-chat-completions`` on a generate-until task (its exact match equals the one computed from
``Generator``'s greedy outputs), from the task files in ``tests/data/lm_eval``; LangChain's
``ChatOpenAI`` streaming."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # the real-model tier: builds engines or runs servers

TASKS = Path(__file__).resolve().parents[1] / "data" / "lm_eval"


def _tasks(folder: Path) -> Path:
    """The repository's task files in ``folder``, their ``DATA`` pointing there, beside their data."""
    for task in TASKS.glob("*.yaml"):
        (folder / task.name).write_text(task.read_text().replace("DATA", str(folder)))
    shutil.copy(TASKS / "loglikelihood.jsonl", folder)
    return folder


def _lm_eval(folder: Path, model: str, model_args: dict, task: str, *flags: str) -> tuple[dict, list[dict]]:
    """``lm_eval``'s command line on ``task``: its results and logged samples."""
    out = folder / "out"
    done = subprocess.run([sys.executable, "-m", "lm_eval", "--model", model,
                           "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
                           "--tasks", task, "--include_path", str(folder), "--output_path", str(out),
                           "--log_samples", *flags],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    [results] = out.rglob("results_*.json")
    [samples] = out.rglob(f"samples_{task}_*.jsonl")
    return (json.loads(results.read_text())["results"][task],
            [json.loads(line) for line in samples.read_text().splitlines()])


def test_lm_eval_loglikelihoods_are_transformers(tiny_server, tmp_path):
    pytest.importorskip("lm_eval")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    url, engine = tiny_server
    folder = _tasks(tmp_path)
    (folder / "generate.jsonl").write_text("")
    results, samples = _lm_eval(folder, "local-completions",
                                dict(model="tiny", base_url=f"{url}/v1/completions",
                                     tokenizer_backend="huggingface", tokenizer=engine / "tokenizer",
                                     num_concurrent=2, max_retries=1),
                                "dspark_loglikelihood")
    target = json.loads((engine / "manifest.json").read_text())["source"]["target"]["path"]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(engine / "tokenizer")
    greedy = []
    assert len(samples) == 6
    for sample in samples:
        arguments = sample["arguments"]["gen_args_0"]
        context, continuation = arguments["arg_0"], arguments["arg_1"]
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        start = len(tokenizer.encode(context, add_special_tokens=False))
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
        rows = logprobs[start - 1:len(whole) - 1]
        expected = rows.gather(-1, torch.tensor(whole[start:])[:, None]).sum().item()
        loglikelihood, is_greedy = sample["resps"][0][0]       # logged as strings
        assert float(loglikelihood) == pytest.approx(expected, abs=1e-4 * (len(whole) - start))
        greedy.append(is_greedy == "True")
        assert greedy[-1] == bool((rows.argmax(-1) == torch.tensor(whole[start:])).all())
    assert results["acc,none"] == pytest.approx(sum(greedy) / len(greedy))


def test_lm_eval_chat_exact_match_is_the_generators(tiny_server, tmp_path):
    """Answers that are ``Generator``'s greedy outputs for every other question: the exact match
    lm-eval computes over the server's answers is the fraction that equals them, 0.5."""
    pytest.importorskip("lm_eval")
    from runtime import Generator

    url, engine = tiny_server
    folder = _tasks(tmp_path)
    questions = [json.loads(line)["question"]
                 for line in (TASKS / "questions.jsonl").read_text().splitlines()]
    outputs = Generator.from_engine(engine).generate(questions, max_new_tokens=12, stop=["zz"]).texts
    answers = [text if i % 2 == 0 else text + " (not the answer)" for i, text in enumerate(outputs)]
    (folder / "generate.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                                                   for q, a in zip(questions, answers)))
    results, samples = _lm_eval(folder, "local-chat-completions",
                                dict(model="tiny", base_url=f"{url}/v1/chat/completions", max_retries=1),
                                "dspark_generate", "--apply_chat_template")
    assert sorted(s["filtered_resps"][0] for s in samples) == sorted(outputs)
    assert results["exact_match,none"] == 0.5


def test_langchain_streams_the_generators_text(tiny_server):
    pytest.importorskip("langchain_openai")
    from functools import reduce
    from operator import add

    from langchain_openai import ChatOpenAI

    from runtime import Generator

    url, engine = tiny_server
    chat = ChatOpenAI(base_url=f"{url}/v1", api_key="none", model="tiny", temperature=0, max_tokens=20,
                      max_retries=0, stream_usage=True)
    chunks = list(chat.stream("the quick brown fox"))
    merged = reduce(add, chunks)
    expected = Generator.from_engine(engine).generate("the quick brown fox", max_new_tokens=20)
    assert len(chunks) > 3 and merged.content == expected.texts[0]
    assert merged.response_metadata["finish_reason"] in ("stop", "length")
    assert merged.usage_metadata["output_tokens"] == len(expected.token_ids[0])
