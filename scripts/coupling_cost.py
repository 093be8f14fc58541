"""What sharing a position's noise between the draft and the target costs in acceptance: on the
contexts of a real run (every draft verified), each first draft's acceptance under rejection
sampling, ``sum(min(p, q))``, and under the shared Gumbel noise the runtime uses
(``runtime/decoding/noise.py``), ``P(argmax(log p + g) == argmax(log q + g))`` over ``--draws``
noise vectors, paired context by context.

    python scripts/coupling_cost.py --engine engines/smollm2-135m-instruct [--prompts 24] [--draws 200]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.decoding.draft_schedule import LoadSchedule  # noqa: E402
from runtime.decoding.generator import Generator  # noqa: E402
from runtime.decoding.sampling import probabilities  # noqa: E402

SETS = (("gsm8k", 180), ("mt-bench", 60))   # held out from the demo draft's distillation


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--prompts", type=int, default=24, help="per set [24]")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draws", type=int, default=200, help="noise vectors per context [200]")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    args = p.parse_args()
    generator = Generator.from_engine(args.engine)
    contexts = record_contexts(generator.backend)
    noise_generator = torch.Generator().manual_seed(0)
    for name, skip in SETS:
        lines = (ROOT / "data" / "prompts" / f"{name}.jsonl").read_text().splitlines()
        prompts = [json.loads(line)["turns"][0] for line in lines[skip:skip + args.prompts]]
        for temperature in args.temperatures:
            contexts.clear()
            generator.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=1,
                               confidence_threshold=0.0, batch_size=1,
                               draft_schedule=LoadSchedule.constant(generator.backend.limits.k))
            rejection, shared = [], []
            for logits, q in contexts:
                target = probabilities(logits, temperature)
                rejection.append(float(torch.minimum(target, q).sum()))
                uniform = torch.rand(args.draws, target.shape[0], generator=noise_generator)
                noise = -torch.log(-torch.log(uniform))
                agree = (torch.log(target) + noise).argmax(-1) == (torch.log(q) + noise).argmax(-1)
                shared.append(float(agree.float().mean()))
            r, s = torch.tensor(rejection), torch.tensor(shared)
            d = s - r
            print(f"{name} T={temperature}: {len(r)} contexts, rejection sampling {r.mean():.4f}, "
                  f"shared noise {s.mean():.4f} ({s.mean() / r.mean():.3f}x), paired difference "
                  f"{d.mean():.4f} +- {2 * d.std() / len(d) ** 0.5:.4f}", flush=True)


def record_contexts(backend) -> list:
    """``(p's logits, q)`` of each verify step's first draft (batch 1), appended as the backend
    runs: the draft's ``q`` of its first draft, then the target's row that checks it."""
    contexts, pending = [], {}
    draft_step, target_step = backend.draft_step, backend.target_step

    def draft(*args, **kwargs):
        tokens, q = draft_step(*args, **kwargs)
        pending["q"] = q[0, 0].clone()
        return tokens, q

    def target(*args, **kwargs):
        logits, taps = target_step(*args, **kwargs)
        if args[0].shape[1] > 1 and "q" in pending:   # a verify call after a draft
            contexts.append((logits[0, 0].float().clone(), pending.pop("q")))
        return logits, taps

    backend.draft_step, backend.target_step = draft, target
    return contexts


if __name__ == "__main__":
    main()
