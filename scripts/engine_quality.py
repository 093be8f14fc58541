"""Teacher-forced quality of engines' target graphs as they run (ONNX Runtime, the engines' own
settings: for quantized weights, int8 activations too), against a reference engine: top-1 agreement
and perplexity on the held-out prompt text ``build --weights`` measures its cost on.

``build`` states the cost of the weights alone (PyTorch, float activations); this states what a
user of the engine gets.

    python scripts/engine_quality.py --reference engines/fp32 engines/int4 engines/gguf
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from export import quality  # noqa: E402
from runtime.backends.ort import OrtBackend  # noqa: E402


def predictions(engine: Path, texts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target graph's top-1 prediction and the true next token's negative log-likelihood at
    every position of ``texts``, each text from position 0 in chunks the engine takes."""
    backend = OrtBackend(engine)
    chunk = backend.limits.max_prompt_chunk
    predictions = []
    for ids in texts:
        backend.start(1)
        rows = []
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start:start + chunk]
            logits, _ = backend.target_step(torch.tensor([piece]), torch.tensor([start]),
                                            torch.arange(len(piece))[None])
            rows.append(logits[0].float().clone())
        predictions.append(quality.next_token_predictions(torch.cat(rows)[:len(ids) - 1], ids))
    return tuple(torch.cat(part) for part in zip(*predictions))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", required=True, type=Path, help="the unquantized engine")
    parser.add_argument("engines", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, help="also write the numbers here (JSON)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.reference / "tokenizer")
    texts = quality.held_out_texts(tokenizer, quality.QUALITY_MAX_TOKENS)
    reference = predictions(args.reference, texts)
    results = {"reference": str(args.reference), "tokens": int(reference[0].numel()),
               "perplexity": math.exp(float(reference[1].mean())), "engines": {}}
    for engine in args.engines:
        cost = quality.quality_cost(reference, predictions(engine, texts))
        results["engines"][str(engine)] = {"top1_agreement": cost["top1_agreement"],
                                           "perplexity": cost["perplexity"]["quantized"]}
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
