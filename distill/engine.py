"""The target through an engine directory built from it (``--engine``): its answers, the engine's
slots kept busy, and its taps by teacher forcing, computed as the draft will read them when that
engine serves it. On the CPU with the compiled kernels the engine runs a batch of sequences in one
call on the quantized weights the user serves, several times faster than the PyTorch target
(``modeling/drafts/smollm2-135m-instruct/README.md``)."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from common import manifest as manifest_file
from runtime.backends.ort import OrtBackend
from runtime.decoding.batcher import Batcher
from runtime.decoding.params import Params


def open_engine(engine: Path, target_dir: Path, taps: tuple[int, ...] | None) -> OrtBackend:
    """The engine's ONNX Runtime backend, refused in one line unless it was built from the files
    of ``target_dir`` (their checksums, as its manifest records them) and its target gives the
    taps ``taps`` (None: any; its draft's ``target_layer_ids``)."""
    manifest = manifest_file.read(engine)
    if manifest["source"]["target"]["files"] != manifest_file.file_hashes(target_dir):
        raise ValueError(f"--engine {engine}: built from another target than --target {target_dir} "
                         f"(the checksums its manifest records differ)")
    built = tuple(manifest["draft"]["target_layer_ids"])
    if taps is not None and built != tuple(taps):
        raise ValueError(f"--engine {engine}: its draft reads target layers {','.join(map(str, built))}; "
                         f"--taps {','.join(map(str, taps))} asks for others (leave --taps out, or "
                         f"build the engine with a draft of those taps)")
    return OrtBackend(engine)


def answers(backend: OrtBackend, prompts: list[list[int]], max_new_tokens: int, temperature: float,
            seed: int, progress: bool) -> list[list[int]]:
    """Each prompt's answer, the target alone (on a CPU a batch's rows cost less than the rows
    speculation verifies), each prompt queued for the next free slot; prompt ``i`` samples from
    ``seed + i`` (``temperature`` 0: greedy)."""
    batcher = Batcher(backend, backend.limits.eos_token_ids)
    requests = [batcher.submit(prompt, Params(max_new_tokens, temperature, seed=seed + i,
                                              speculative=False), f"prompt {i + 1}")
                for i, prompt in enumerate(prompts)]
    label = "greedy answers" if temperature == 0 else f"answers at T = {temperature:g}"
    with tqdm(total=len(requests), desc=label, unit="prompt", disable=not progress) as bar:
        while batcher.busy:
            bar.update(sum(request.finished for request in batcher.step()))
    return [request.token_ids for request in requests]


@torch.no_grad()
def taps(backend: OrtBackend, tokens: torch.Tensor) -> torch.Tensor:
    """The taps ``[S, T * H]`` of one sequence ``tokens [S]``, teacher-forced through the engine's
    target in chunks of its ``max_prompt_chunk`` rows, on slot 0 of the started backend (each chunk
    writes the rows the next one reads, over what an earlier sequence left)."""
    limits, chunk, rows = backend.limits, backend.limits.max_prompt_chunk, []
    for begin in range(0, tokens.numel(), chunk):
        ids = tokens[None, begin:begin + chunk]
        last = torch.tensor([[ids.shape[1] - 1]])
        state = (torch.zeros(1, dtype=torch.long), last) if limits.state_slots else (None, None)
        _, aux = backend.target_step(ids, torch.tensor([begin]), last, *state)
        rows.append(aux[0].clone())   # the backend reuses its output buffer
    return torch.cat(rows)
