"""A request as the loop keeps it between steps: its options, what it generated, its place in the
backend's caches and the draft context it has not handed to the draft yet."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from runtime.decoding.acceptance import Acceptance
from runtime.decoding.logprobs import TokenLogprob
from runtime.decoding.noise import Noise
from runtime.decoding.params import Params
from runtime.decoding.penalties import Penalties
from runtime.decoding.stats import SpecStats
from runtime.decoding.stop_strings import StopStrings


@dataclass
class DraftContext:
    """The target's rows (its taps) of verified tokens that the draft has not read yet:
    ``rows [count, D]``, at positions ``start ..``. The draft's next call inserts them, ahead of
    proposing from the anchor that follows them."""
    rows: torch.Tensor
    start: int

    @property
    def count(self) -> int:
        return self.rows.shape[0]

    def then(self, row: torch.Tensor) -> "DraftContext":
        """These rows and ``row [D]`` after them, in the storage of ``rows`` where it has room past
        them (twice the rows where not): a request taking target-only steps adds a context row a
        step without copying those before."""
        rows, count = self.rows, self.count
        room = rows.untyped_storage().nbytes() // (rows.element_size() * rows.shape[1])
        if rows.storage_offset() or not rows.is_contiguous() or room <= count:
            grown = rows.new_empty(max(2 * count, 16), rows.shape[1])
            grown[:count] = rows
            rows = grown[:count]
        whole = rows.as_strided((count + 1, rows.shape[1]), rows.stride())
        whole[count] = row
        return DraftContext(whole, self.start)


class Status(Enum):
    """Where a request is: queued for a free slot, in a slot with its prompt going through the
    target a chunk per step, in a slot gaining tokens every step, or ended (``finish_reason``
    says why; a request cancelled while its group prefills keeps its slot until the group is
    done)."""
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One prompt's generation. ``token_ids`` grows as steps emit; ``finish_reason`` is set when
    it ends: ``"stop"`` (EOS or a stop string), ``"length"`` (``max_new_tokens``) or
    ``"cancelled"``. ``trace`` has a record per step: its anchor, the drafts it verified, how many
    were accepted and the tokens it emitted."""
    id: int
    prompt: list[int]
    params: Params
    status: Status = Status.WAITING
    token_ids: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=lambda: SpecStats(k=0))
    acceptance: Acceptance | None = None    # what adaptive verification plans its steps with
    finish_reason: str | None = None
    trace: list[dict] = field(default_factory=list)
    slot: int | None = None
    reused: int = 0               # prompt tokens its slot's caches held already (not prefilled)
    # between steps: the anchor (the last emitted token, not yet run by the target) and its position
    # (= the target caches' valid length, also while the prompt is prefilled)
    anchor: int = 0
    anchor_pos: int = 0
    context: DraftContext | None = None     # with speculation, once prefilled
    state_slot: int = 0           # a hybrid target's state slot holding the state after the anchor
    noise: Noise | None = None    # a sampled request's, by position
    penalty: Penalties | None = None
    prefill: "Prefill | None" = None      # the group it is prefilled with, until the group is done
    # with ``params.logprobs`` / ``prompt_logprobs``: one per generated token / prompt token after the first
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = Status.FINISHED, reason


@dataclass(eq=False)
class Prefill:
    """Requests admitted together, prefilled together one chunk per step (``prefill_chunks``):
    the rows of each one's prompt past what its slot held already."""
    requests: list[Request]
    done: int = 0                 # prompt rows prefilled so far

    @property
    def rows(self) -> int:
        return max(len(r.prompt) - r.reused for r in self.requests)


def extend(out: list[int], tokens: list[int], max_new_tokens: int, eos: set[int],
           stop: StopStrings | None) -> str | None:
    """Append ``tokens`` to ``out`` up to the first EOS (kept), the token that completes a stop
    string, or ``max_new_tokens`` in all; the reason the sequence ended there (``"stop"`` or
    ``"length"``), or None while it goes on."""
    for token in tokens[: max_new_tokens - len(out)]:
        out.append(token)
        if token in eos or (stop is not None and stop.reached(out)):
            return "stop"
    return "length" if len(out) >= max_new_tokens else None
