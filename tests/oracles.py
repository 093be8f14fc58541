"""Oracle drafts, shared by the invariant tests: the real draft runs (so its cache bookkeeping is
exercised), then a random-length prefix of its proposals is overwritten with the target's true
continuation, so that every acceptance count 0..k, rollback and bonus path of the loop is taken;
and the greedy invariant checked with them in PyTorch and on an engine."""
import random

import torch

from modeling.pair import load_pair
from runtime.backends.ort import OrtBackend
from runtime.backends.pytorch import TorchBackend
from runtime.decoding.batch import generate

from conftest import PROMPTS, hf_greedy

MAX_NEW = 40
CHUNK = 5   # shorter than two of the prompts: the state crosses prefill chunks


class OracleDrafts(TorchBackend):
    """Runs the real draft (so its cache bookkeeping is exercised), then overwrites a random-length
    prefix of its proposals with the target's true continuation, so that 0..k drafts are accepted
    and every acceptance length, rollback and bonus path of the loop is taken."""

    def __init__(self, target, draft, prompts, continuations, seed=0, capacity=96, **options):
        super().__init__(target, draft, capacity=capacity, **options)
        self.prompt_lengths = [len(p) for p in prompts]
        self.continuations = continuations
        self.rng = random.Random(seed)

    def draft_step(self, ctx_aux, ctx_start, ctx_count, anchor, temperature, noise, slots=None):
        tokens, q = super().draft_step(ctx_aux, ctx_start, ctx_count, anchor, temperature, noise, slots)
        anchor_pos = (ctx_start + ctx_count).tolist()
        for b, pos in enumerate(anchor_pos):
            truth = self.continuations[b][pos - self.prompt_lengths[b] + 1:]
            right = min(self.rng.randint(0, self.limits.k), len(truth))
            tokens[b, :right] = torch.tensor(truth[:right], dtype=torch.long)
        return tokens, q


class OrtOracle(OrtBackend):
    """``OracleDrafts`` on the engine: the real draft graph runs, then a random-length prefix of its
    proposals is overwritten with the target's true continuation."""

    def __init__(self, engine, prompts, continuations, seed=0):
        super().__init__(engine)
        self.prompt_lengths, self.continuations = [len(p) for p in prompts], continuations
        self.rng = random.Random(seed)

    def draft_step(self, ctx_aux, ctx_start, ctx_count, anchor, temperature, noise, slots=None):
        tokens, q = super().draft_step(ctx_aux, ctx_start, ctx_count, anchor, temperature, noise,
                                       slots=slots)
        tokens = tokens.clone()
        sequences = range(len(anchor)) if slots is None else slots   # a batch's prompt i is in slot i
        for b, (i, pos) in enumerate(zip(sequences, (ctx_start + ctx_count).tolist())):
            truth = self.continuations[i][pos - self.prompt_lengths[i] + 1:]
            right = min(self.rng.randint(0, self.limits.k), len(truth))
            tokens[b, :right] = torch.tensor(truth[:right], dtype=torch.long)
        return tokens, q


def check_torch_invariant(target_dir, draft_dir) -> OracleDrafts:
    """Greedy speculative == target-only == ``transformers`` ``generate`` in PyTorch, batch 1 and
    3, over ``CHUNK``-row prefill chunks, with oracle drafts that take every acceptance count at
    batch 3; returns that batch's backend."""
    target, draft = load_pair(target_dir, draft_dir)
    eos = target.config.eos_token_ids
    expected = hf_greedy(target_dir, PROMPTS, MAX_NEW)
    continuations = hf_greedy(target_dir, PROMPTS, MAX_NEW, eos=None)   # the oracle's truth
    for batch in (1, 3):
        prompts = PROMPTS[:batch]
        oracle = OracleDrafts(target, draft, prompts, continuations, max_prompt_chunk=CHUNK)
        result = generate(oracle, prompts, max_new_tokens=MAX_NEW, eos_token_ids=eos)
        assert result.token_ids == expected[:batch]
        if batch == 3:
            assert {r["accepted"] for r in result.trace if r["step"] > 0} == set(range(draft.k + 1))
        target_only = generate(TorchBackend(target, None, capacity=96, max_prompt_chunk=CHUNK), prompts,
                               max_new_tokens=MAX_NEW, eos_token_ids=eos)
        assert target_only.token_ids == expected[:batch]
    return oracle


def check_engine_invariant(engine, target_dir) -> None:
    """``check_torch_invariant`` on an engine directory, through ONNX Runtime."""
    expected = hf_greedy(target_dir, PROMPTS, MAX_NEW)
    continuations = hf_greedy(target_dir, PROMPTS, MAX_NEW, eos=None)
    for batch in (1, 3):
        prompts = PROMPTS[:batch]
        oracle = OrtOracle(engine, prompts, continuations)
        result = generate(oracle, prompts, max_new_tokens=MAX_NEW, eos_token_ids=oracle.limits.eos_token_ids)
        assert result.token_ids == expected[:batch]
        if batch == 3:
            assert {r["accepted"] for r in result.trace if r["step"] > 0} == set(range(oracle.limits.k + 1))
        target_only = generate(oracle, prompts, max_new_tokens=MAX_NEW, speculative=False,
                               eos_token_ids=oracle.limits.eos_token_ids)
        assert target_only.token_ids == expected[:batch]


def check_speculative_equals_target_only(engine) -> None:
    """On a quantized engine, whose products round otherwise than ``transformers``' float ones:
    speculative output with every acceptance count equals the engine's target-only output, batch
    1 and 3."""
    backend = OrtBackend(engine)
    for batch in (1, 3):
        prompts = PROMPTS[:batch]
        target_only = generate(backend, prompts, max_new_tokens=MAX_NEW, speculative=False).token_ids
        oracle = OrtOracle(engine, prompts, target_only)
        result = generate(oracle, prompts, max_new_tokens=MAX_NEW)
        assert result.token_ids == target_only
        if batch == 3:
            assert {r["accepted"] for r in result.trace if r["step"] > 0} == set(range(oracle.limits.k + 1))
