"""KV-cache bytes per sequence of a preset's engine: the caches ``build`` gives its target graph
(a Gemma 4 target's sliding layers as rings of their window plus the rows a call writes) beside
what caches of ``--max-seq-len`` rows for every layer would take. The shapes are the engine's
own (``export.onnx_export.target_spec``'s), read from the preset's config.json alone.

    python scripts/cache_memory.py [--preset gemma4-12b] [--max-seq-len 8192 32768]
        [--max-prompt-chunk 512] [--k 7] [--dtype bf16]
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.manifest import call_rows  # noqa: E402
from modeling import gemma4  # noqa: E402
from modeling.fixtures.presets import PRESETS, gemma4_layer_types  # noqa: E402
from modeling.target_config_reader import load_target_config  # noqa: E402

BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def preset_config(name: str):
    """The preset's target config, as ``load_target_config`` reads its config.json."""
    import transformers

    preset = PRESETS[name]
    text = transformers.Gemma4UnifiedTextConfig(**preset.shape(), **preset.gemma4,
                                                layer_types=gemma4_layer_types(preset.num_hidden_layers))
    outer = transformers.Gemma4UnifiedConfig(text_config=text.to_dict(),
                                             architectures=["Gemma4UnifiedForConditionalGeneration"])
    with tempfile.TemporaryDirectory() as directory:
        outer.save_pretrained(directory)
        return load_target_config(Path(directory))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gemma4-12b", choices=[n for n, v in PRESETS.items() if v.gemma4])
    p.add_argument("--max-seq-len", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--max-prompt-chunk", type=int, default=512)
    p.add_argument("--k", type=int, default=7, help="drafts per step (the release's block 7)")
    p.add_argument("--dtype", default="bf16", choices=list(BYTES))
    args = p.parse_args()
    config = preset_config(args.preset)
    layout = config.gemma4
    rows = call_rows(args.max_prompt_chunk, args.k)
    print(f"{args.preset}: {layout.layer_types.count('sliding_attention')} sliding layers (window "
          f"{layout.sliding_window}), {layout.layer_types.count('full_attention')} full; batch 1, "
          f"{args.dtype}, prompt chunk {args.max_prompt_chunk}, k {args.k}: rings of "
          f"{layout.sliding_window + rows - 1} rows")
    print(f"{'max_seq_len':>11}  {'engine caches':>13}  {'full-length caches':>18}  ratio")
    for capacity in args.max_seq_len:
        engine, full = (sum(math.prod(spec.shape) for spec in
                            gemma4.cache_specs(config, 1, capacity, r, torch.float32))
                        * BYTES[args.dtype] for r in (rows, capacity))
        print(f"{capacity:>11}  {engine / 2**30:10.2f} GiB  {full / 2**30:15.2f} GiB  {engine / full:5.1%}")


if __name__ == "__main__":
    main()
