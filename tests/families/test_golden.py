"""The independent oracle: drafts saved by DeepSpec's own code and the traces DeepSpec produced,
for a Qwen3 pair and a Gemma 4 pair (``tests/data/golden/*/README.md``)."""
import dataclasses
import json

import pytest

from modeling.draft import load_draft
from modeling.target import load_target
from runtime.backends.pytorch import TorchBackend
from runtime.decoding.batch import generate

from conftest import GEMMA4_GOLDEN, GOLDEN


@pytest.fixture(scope="module", params=[GOLDEN, GEMMA4_GOLDEN], ids=["qwen3", "gemma4"])
def golden(request):
    records = [json.loads(line) for line in (request.param / "expected.jsonl").read_text().splitlines()]
    target = load_target(request.param / "target", taps=(1, 3))
    draft = load_draft(request.param / "draft-deepspec", target)
    return records, TorchBackend(target, draft, capacity=128)


def _steps(result, sequence):
    return [{key: r[key] for key in ("anchor", "drafts", "accepted")}
            for r in result.trace if r["sequence"] == sequence and r["step"] > 0]


def test_every_step_matches_deepspec_batch_1(golden):
    records, backend = golden
    for record in records:
        result = generate(backend, [record["prompt_ids"]], max_new_tokens=32)
        assert result.token_ids[0] == record["target_greedy"] == record["spec_tokens"]
        assert _steps(result, 0) == record["steps"]


@pytest.mark.parametrize("chunk", [128, 5], ids=["one-prefill-call", "chunked-prefill"])
def test_every_step_matches_deepspec_batch_3_ragged(golden, chunk, monkeypatch):
    """Also with prompts prefilled in chunks of 5 rows, each chunk inserted into the draft context
    as it comes: the proposals must not change. A Gemma 4 target's sliding layers then keep rings
    of their window plus 5 rows, which the prompts and the 32 new tokens wrap many times."""
    records, backend = golden
    monkeypatch.setattr(backend, "limits", dataclasses.replace(backend.limits, max_prompt_chunk=chunk))
    assert len({len(r["prompt_ids"]) for r in records}) == 3
    result = generate(backend, [r["prompt_ids"] for r in records], max_new_tokens=32)
    for b, record in enumerate(records):
        assert result.token_ids[b] == record["target_greedy"]
        assert _steps(result, b) == record["steps"]
    # the trace shows real acceptance, so the accepted-row bookkeeping is exercised
    assert max(s["accepted"] for r in records for s in r["steps"]) == 4
    if backend.target.config.gemma4 is not None:
        window = backend.target.config.gemma4.sliding_window
        rings = {cache.shape[2] for cache in backend.target_cache}
        assert rings == ({window + chunk - 1, 128} if chunk < 128 else {128})
