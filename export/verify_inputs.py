"""The inputs a build traces each graph with and verifies it on, and the PyTorch reference's outputs
on them: sizes that keep every dynamic axis dynamic, and for the target rows of real text behind
cache rows the target itself wrote, as a run has them (``build.py`` compares the graph's outputs
with the reference's there).
"""
from __future__ import annotations

import torch

from common import manifest as manifest_file
from export.onnx_export import BuildLimits, GraphSpec, sample_inputs
from modeling.dense import TargetStep


def example_inputs(spec: GraphSpec, limits: BuildLimits, vocab: int, block: int,
                    generator: torch.Generator) -> tuple[dict, dict]:
    """Deterministic inputs for one graph: one set to trace with, another (other sizes) to verify
    with, so that the dynamic axes are really dynamic. Each sequence's ``logit_rows`` are drawn
    apart (a ragged choice, as the loop's prefill makes), and every axis size differs from the
    others and from 1, which torch.export would otherwise take for a constant or for a link between
    axes.

    The caches are zeros. The target's verified rows start near the front of them, where
    ``with_context`` writes real rows before them: behind a long run of zero K/V rows, which
    every query attends to with score 0 and which no real run has, the attention output shrinks
    towards zero and rounding dominates (an fp32 run with its weights merely rounded to fp16 moved
    the demo target's logits by 6%, relative, and the fp16 PyTorch reference was 10% off fp32).
    Far positions are the trace's, and the draft's (its block attends to its rows, not only to
    zeros)."""
    capacity, sets = limits.max_seq_len, []
    for purpose, batch, rows, logit_rows in (("trace", 2, 3, 4), ("verify", min(3, limits.max_batch), 5, 2)):
        rows = min(rows, limits.max_prompt_chunk) if purpose == "verify" else rows
        if capacity < rows + block:
            raise ValueError(f"--max-seq-len {capacity}: too small to hold a prompt chunk and a "
                             f"draft block of {block}")
        slots = _slots(spec)
        sizes = {"batch": batch, "rows": rows, "ctx_rows": rows, "logit_rows": logit_rows,
                 "state_rows": min(slots, logit_rows + 1)}
        far = capacity - rows + 1
        high = {"input_ids": vocab, "start": far if purpose == "trace" else min(far, 2 * rows),
                "logit_rows": rows, "ctx_start": capacity - rows - block + 1, "ctx_count": rows + 1,
                "anchor": vocab, "state_slot": slots, "state_rows": rows + 1}
        inputs = sample_inputs(spec, sizes, generator, high)
        if "state_rows" in inputs:
            inputs["state_rows"] -= 1    # -1: the state before the call
        if "noise" in inputs:
            inputs["temperature"] = torch.ones(batch)
            inputs["noise"] = torch.zeros_like(inputs["noise"])  # greedy: tokens compare exactly
        sets.append(inputs)
    return sets[0], sets[1]


def _slots(spec: GraphSpec) -> int:
    """A hybrid target's state slots (the static slot axis of its state caches), else 1."""
    return next((t.shape[1] for t in spec.inputs if t.name.startswith("state_cache_")), 1)


def with_context(target: TargetStep, inputs: dict, texts: list[list[int]] | None, chunk: int) -> dict:
    """The target's verify ``inputs`` as a run has them: each sequence's rows are real text
    (``texts``, token ids; kept random where there is none), and the cache rows before its
    ``start`` hold that text's beginning, written by the target itself in prefill calls of at most
    ``chunk`` rows from position 0, as a run writes them (a sliding layer's ring holds no more per
    call; a hybrid's state is kept after each prefix in one call). The rows it writes past a
    sequence's start are scratch, which the verified rows overwrite or no query sees. On random ids
    a real model's activations are unlike any run's: the demo target's fp16 module was 2.5% off
    fp32 there, 0.5% on text."""
    caches = [name for name in inputs if manifest_file.is_cache(name)]
    start, ids = inputs["start"], inputs["input_ids"].clone()
    batch, rows = ids.shape
    longest = int(start.max())
    prefix = torch.zeros(batch, longest, dtype=torch.long)
    usable = [text for text in texts or () if len(text) >= longest + rows]
    for b in range(batch if usable else 0):
        text = torch.tensor(usable[b % len(usable)])
        prefix[b] = text[:longest]
        ids[b] = text[int(start[b]):int(start[b]) + rows]
    inputs = {**inputs, "input_ids": ids}
    if longest == 0:
        return inputs
    first = torch.zeros(batch, 1, dtype=torch.long)
    # a hybrid target keeps the state after each sequence's prefix in slot 0, where it then starts
    states = {"state_slot": first[:, 0], "state_rows": start[:, None] - 1} if "state_slot" in inputs else {}
    written = [inputs[name] for name in caches]
    step = longest if states else chunk
    with torch.no_grad():
        for begin in range(0, longest, step):
            written = target(prefix[:, begin:begin + step], torch.full_like(start, begin), first,
                             *states.values(), *written)[2:]
    return {**inputs, **dict(zip(caches, written)), **({"state_slot": first[:, 0]} if states else {})}


def reference_outputs(module: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """``module``'s outputs on ``inputs``; the caches among them are updated copies of inputs."""
    with torch.no_grad():
        return list(module(*inputs.values()))
