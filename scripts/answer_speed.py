"""Tokens/s of the target's answers as ``distill`` generates its data: the PyTorch target
(``GENERATION_BATCH`` prompts at a time) against an engine directory of it (``--engine``: its
slots kept busy), greedy and at T = 1, interleaved and repeated in one process; also the target's
taps, teacher-forced both ways (distill's README records the numbers).

    python scripts/answer_speed.py --target T.gguf --engine engines/smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.prompts import encode_prompt  # noqa: E402
from distill import data  # noqa: E402
from distill import engine as engine_target  # noqa: E402
from distill.prompts import load_tokenizer  # noqa: E402
from modeling.checkpoint import resolve  # noqa: E402
from modeling.target import from_start, load_target  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--engine", required=True)
    p.add_argument("--prompts-file", type=Path, default=ROOT / "data/prompts/gsm8k.jsonl")
    p.add_argument("--prompts", type=int, default=32, help="the file's first records")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    target_dir = resolve(args.target, "target")
    backend = engine_target.open_engine(Path(args.engine), target_dir, None)
    target = load_target(target_dir, taps=tuple(backend.manifest["draft"]["target_layer_ids"]))
    tokenizer = load_tokenizer(target_dir)
    lines = args.prompts_file.read_text().splitlines()[:args.prompts]
    prompts = [encode_prompt(tokenizer, json.loads(line)["turns"][0]) for line in lines]
    paths = {"pytorch": lambda t: data._torch_answers(target, prompts, args.max_new_tokens, t, 0, False),
             "engine": lambda t: engine_target.answers(backend, prompts, args.max_new_tokens, t, 0, False)}
    speeds = {(name, t): [] for name in paths for t in (0.0, 1.0)}
    answers = {}
    for _ in range(args.repeat):
        for (name, temperature) in speeds:
            began = time.perf_counter()
            answers[name, temperature] = paths[name](temperature)
            tokens = sum(map(len, answers[name, temperature]))
            speeds[name, temperature].append(tokens / (time.perf_counter() - began))
    for (name, temperature), runs in speeds.items():
        print(f"answers, {name:8s} T = {temperature:g}: {statistics.median(runs):7.1f} tok/s "
              f"({', '.join(f'{r:.1f}' for r in runs)})")
    sequences = [torch.tensor(p + a) for p, a in zip(prompts, answers["engine", 0.0])]
    backend.start(1)
    taps = {"pytorch": lambda s: from_start(target, s[None], torch.zeros(1, 0, dtype=torch.long))[1],
            "engine": lambda s: engine_target.taps(backend, s)}
    rows = sum(s.numel() for s in sequences)
    for name, run in taps.items():
        began = time.perf_counter()
        with torch.no_grad():
            for sequence in sequences:
                run(sequence)
        print(f"taps, {name:8s}: {rows / (time.perf_counter() - began):7.1f} rows/s")


if __name__ == "__main__":
    main()
