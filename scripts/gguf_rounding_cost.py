"""What rounding a GGUF file's Q6_K blocks again costs (``build --weights gguf`` keeps every other
type's values; ``export/gguf_blocks.py``): the target teacher-forced on the held-out text that
``build --weights int4`` states its cost on, with the file's values and with the values the engine
computes with (PyTorch, float activations): top-1 agreement and both perplexities.

    python scripts/gguf_rounding_cost.py TARGET.gguf
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from export.gguf_blocks import GgufBlocks  # noqa: E402
from export.quality import QUALITY_MAX_TOKENS, held_out_texts, quality_cost, teacher_forced  # noqa: E402
from export.quantize import round_weights  # noqa: E402
from modeling.checkpoint import hf_location  # noqa: E402
from modeling.target import load_target  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target", type=Path, help="a .gguf target")
    args = p.parse_args()
    from transformers import AutoTokenizer

    location, options = hf_location(args.target)
    texts = held_out_texts(AutoTokenizer.from_pretrained(location, **options), QUALITY_MAX_TOKENS)
    if not texts:
        sys.exit("the held-out prompt text is not installed (a clone has it: data/prompts)")
    target = load_target(args.target)
    reference = teacher_forced(target, texts)
    blocks = GgufBlocks(args.target)
    rounded = round_weights(target, blocks.engine_values)
    print(json.dumps({"file": str(args.target), "types": blocks.types, "rounded_matrices": rounded,
                      **quality_cost(reference, teacher_forced(target, texts))}, indent=1))


if __name__ == "__main__":
    main()
