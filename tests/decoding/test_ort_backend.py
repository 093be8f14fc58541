"""The ONNX Runtime backend over engine directories: the greedy invariant, parity with the
PyTorch backend, chunked prefill, caches bound in place, and engine limits."""
import numpy as np
import pytest
import torch

from common.manifest import is_cache
from modeling.pair import load_pair
from runtime.backends.ort import OrtBackend
from runtime.backends.pytorch import TorchBackend
from runtime.decoding.batch import generate

from conftest import ENGINE_CASES, LIMITS, PROMPTS, hf_greedy

# a prompt chunk of 8 rows makes the longest prompt (11 tokens) take two prefill calls


@pytest.fixture(scope="module", params=ENGINE_CASES)
def case(request, tiny, engine_dir):
    fields = ENGINE_CASES[request.param]
    return OrtBackend(engine_dir(LIMITS, **fields)), tiny(**fields)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_through_onnx_runtime_equals_transformers(case, batch):
    backend, (target_dir, _) = case
    result = generate(backend, PROMPTS[:batch], max_new_tokens=40,
                      eos_token_ids=backend.limits.eos_token_ids)
    assert result.token_ids == hf_greedy(target_dir, PROMPTS[:batch], 40)


def test_onnx_runtime_and_torch_backends_agree(case):
    backend, (target_dir, draft_dir) = case
    target, draft = load_pair(target_dir, draft_dir)
    reference = TorchBackend(target, draft, capacity=LIMITS.max_seq_len)
    for temperature in (0.0, 1.0):
        ort_result = generate(backend, PROMPTS, max_new_tokens=30, temperature=temperature, seed=5)
        torch_result = generate(reference, PROMPTS, max_new_tokens=30, temperature=temperature, seed=5)
        assert ort_result.token_ids == torch_result.token_ids
        assert ort_result.trace == torch_result.trace


def test_the_limits_read_from_the_manifest_are_the_modules_own(case):
    """The backend contract's one ``BuildLimits``: an engine's, read from its manifest, equal the
    reference modules' for the same pair and build limits; the capacity a run needs follows it."""
    from runtime.backends.base import BackendLimits, capacity_needed

    backend, _ = case
    reference = TorchBackend.from_engine(backend.directory)
    assert backend.limits == reference.limits
    assert backend.limits == BackendLimits.from_manifest(backend.manifest)
    limits = backend.limits
    assert limits.lookahead == max(limits.k + 1, limits.block_size) > 1
    assert capacity_needed(10, 20, limits) == 30 + limits.lookahead and capacity_needed(10, 20) == 31


def test_caches_are_bound_in_place(case):
    """The caches are buffers bound as input and output: after a step the outputs are the very
    buffers bound in start(), each sequence's rows holding its new rows. A batched target's are
    one pool (a slot per sequence, ``plugins/cpu``), else each sequence has buffers of its own."""
    backend, _ = case
    backend.start(2)
    count = sum(is_cache(t["name"]) for t in backend.manifest["graphs"]["target"]["inputs"])
    bindings = [backend.pools["target"][1]] if backend.batched else [b["target"] for b in backend.bindings]
    before = [[v.data_ptr() for v in binding.get_outputs()[:count]] for binding in bindings]
    backend.target_step(torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([0, 4]), torch.tensor([[2], [0]]))
    after = [binding.get_outputs()[:count] for binding in bindings]
    assert [[v.data_ptr() for v in values] for values in after] == before
    assert len({pointer for pointers in before for pointer in pointers}) == len(bindings) * count
    k0 = after[-1][0].numpy()[-1]   # sequence 1's first key cache
    assert abs(k0[:, 4:7]).sum() > 0 and abs(k0[:, :4]).sum() == 0  # sequence 1 wrote at its start
    if backend.batched:
        assert before[0][0] == backend.pools["target"][0][0].ctypes.data


def test_a_new_sequence_reads_nothing_its_slot_held(case, monkeypatch):
    """A pooled graph's K/V rows are not zeroed for a slot's next sequence: its attention reads only
    the rows the sequence wrote. With every pooled cache filled with NaN when the pool starts, a
    batch decodes the same tokens, drafts and acceptances as on zeroed caches (a stale row read
    by the target or by the draft would change one of them)."""
    backend, (target_dir, _) = case
    if not backend.pool_graphs:
        pytest.skip("no compiled kernels here: every sequence gets caches of its own")
    options = dict(max_new_tokens=30, eos_token_ids=backend.limits.eos_token_ids)
    zeroed = generate(backend, PROMPTS[:3], **options)
    start = backend.start

    def poisoned(batch):
        start(batch)
        for caches, _ in backend.pools.values():
            for cache in caches:
                cache.fill(np.nan)

    monkeypatch.setattr(backend, "start", poisoned)
    stale = generate(backend, PROMPTS[:3], **options)
    assert stale.token_ids == zeroed.token_ids == hf_greedy(target_dir, PROMPTS[:3], 30)
    assert stale.trace == zeroed.trace and any(record["accepted"] for record in zeroed.trace)


def test_a_draft_step_of_several_sequences_gives_each_what_it_gives_alone(case):
    """The draft's batch in one call over a pool of slots (where the compiled kernels are built):
    each sequence's proposals and probabilities are the bits it gets alone in its slot, on other
    slots, behind other context lengths and beside another sequence's padded context rows."""
    from plugins.cpu.build import library

    backend, _ = case
    assert ("draft" in backend.pool_graphs) == (library() is not None)
    draft = backend.manifest["draft"]
    g = torch.Generator().manual_seed(3)
    width = backend.manifest["graphs"]["draft"]["inputs"][0]["shape"][-1]
    before, count = torch.tensor([3, 9, 5]), torch.tensor([6, 2, 4])   # context rows: written, new
    ctx = torch.randn(3, 9 + 6, width, generator=g)
    anchor, temperature, slots = torch.tensor([5, 17, 30]), torch.tensor([1.0, 0.5, 1.0]), [2, 0, 1]
    noise = -torch.log(-torch.log(torch.rand(3, draft["k"], draft["target_vocab_size"], generator=g)))

    def steps(rows: list[int]):
        """The context before, then the step measured, for the sequences ``rows`` on their slots."""
        padded = lambda counts: int(counts[rows].max())   # noqa: E731
        ids = [slots[b] for b in rows]
        backend.draft_step(ctx[rows, :padded(before)], torch.zeros(len(rows), dtype=torch.long), before[rows],
                           anchor[rows], temperature[rows], noise[rows], ids)
        new = torch.stack([ctx[b, before[b]:before[b] + padded(count)] for b in rows])
        tokens, q = backend.draft_step(new, before[rows], count[rows], anchor[rows], temperature[rows],
                                       noise[rows], ids)
        return tokens.clone(), q.clone()

    backend.start(3)
    tokens, q = steps([0, 1, 2])
    for b in range(3):
        backend.start(3)
        alone = steps([b])
        assert torch.equal(alone[0][0], tokens[b]) and torch.equal(alone[1][0], q[b])
    assert len({tuple(t.tolist()) for t in tokens}) == 3 and torch.isfinite(q).all()


def test_engine_limits_are_enforced(case):
    backend, _ = case
    with pytest.raises(ValueError, match="needs .* KV-cache rows; the capacity is 96"):
        generate(backend, [list(range(5, 60))], max_new_tokens=60)
    with pytest.raises(ValueError, match="at most 4"):
        generate(backend, [[5, 6]] * 5, max_new_tokens=2)
