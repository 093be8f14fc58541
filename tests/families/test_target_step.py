"""``TargetStep`` against ``transformers``' own model, fp32, to 1e-4."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from modeling.target import every_row, load_target

TOL = 1e-4


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request, tiny):
    target_dir, _ = tiny(arch=request.param)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return load_target(target_dir, taps=(-1, 0, 2)), hf


def _ids(length, seed=0):
    return torch.randint(5, 80, (1, length), generator=torch.Generator().manual_seed(seed))


def test_prefill_logits_and_taps(pair):
    target, hf = pair
    ids = _ids(12)
    reference = hf(ids, output_hidden_states=True)
    logits, aux, *_ = target(ids, torch.tensor([0]), every_row(ids), *target.empty_cache(1, 32))
    assert (logits - reference.logits).abs().max() < TOL
    # taps are raw residual streams: embeddings (-1), after layer 0, after layer 2, in that order
    hidden = target.config.decoder.hidden_size
    for i, layer in enumerate((-1, 0, 2)):
        assert (aux[..., i * hidden:(i + 1) * hidden] - reference.hidden_states[layer + 1]).abs().max() < TOL


@pytest.mark.parametrize("step", [1, 5])  # a decode step and a verify step of k + 1 = 5 rows
def test_incremental_steps_match_full_forward(pair, step):
    target, hf = pair
    ids = _ids(16, seed=1)
    reference = hf(ids).logits
    cache = target.empty_cache(1, 32)
    logits, _, *cache = target(ids[:, :6], torch.tensor([0]), every_row(ids[:, :6]), *cache)
    pieces = [logits]
    for begin in range(6, 16, step):
        chunk = ids[:, begin:begin + step]
        logits, _, *cache = target(chunk, torch.tensor([begin]), every_row(chunk), *cache)
        pieces.append(logits)
    assert (torch.cat(pieces, dim=1) - reference).abs().max() < TOL


def test_batch_rows_are_independent_with_ragged_lengths(pair):
    """Each row writes at its own start; rows past a row's valid length are scratch. The prefill
    asks for each prompt's last two rows (``logit_rows`` differ per sequence), the step for all."""
    target, hf = pair
    prompts = [_ids(n, seed=n)[0] for n in (3, 9, 6)]
    padded = torch.zeros(3, 9, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    cache = target.empty_cache(3, 32)
    last_two = torch.tensor([[len(p) - 2, len(p) - 1] for p in prompts])
    logits, _, *cache = target(padded, torch.zeros(3, dtype=torch.long), last_two, *cache)
    assert logits.shape == (3, 2, target.config.vocab_size)
    next_ids = torch.tensor([[7, 8], [9, 10], [11, 12]])
    step_logits, _, *cache = target(next_ids, torch.tensor([len(p) for p in prompts]), every_row(next_ids),
                                    *cache)
    for b, p in enumerate(prompts):
        full = torch.cat([p, next_ids[b]])[None]
        reference = hf(full).logits[0]
        assert (logits[b] - reference[len(p) - 2:len(p)]).abs().max() < TOL
        assert (step_logits[b] - reference[len(p):]).abs().max() < TOL
