"""What a free slot's caches still hold, so that a request whose prompt begins with it prefills only
the rest (llama-server's slot reuse, ``cache_prompt``): the same system prompt, the conversation
so far. A request that ends leaves its slot's caches as they are; the next request placed there
keeps the rows its prompt shares with them and overwrites the others.

A target that cannot go back to an earlier row (a hybrid's recurrent state is kept only after the
last verified row; a sliding layer's ring drops old rows as new ones come) reuses a slot only when
its whole held sequence begins the new prompt."""
from __future__ import annotations

from dataclasses import dataclass, field

from runtime.decoding.request import DraftContext


@dataclass
class Held:
    """A slot's caches: ``tokens`` whose target rows are valid (rows ``0 .. len - 1``), the first
    ``draft_rows`` of them in the draft's context too, and the draft context rows not yet inserted
    (``pending``, from ``draft_rows`` on); a hybrid target's state after
    the last of ``tokens`` in state slot ``state_slot``. ``since`` orders slots by when their
    request left (an unused slot is the oldest)."""
    tokens: list[int] = field(default_factory=list)
    draft_rows: int = 0
    pending: DraftContext | None = None
    state_slot: int = 0
    since: int = 0

    def reusable(self, prompt: list[int], speculative: bool, exact: bool) -> int:
        """How many of ``prompt``'s first rows these caches already hold: their common prefix,
        less the prompt's last token (its row gives the first token's logits), and for a request
        with drafts only the rows the draft has or can insert; with ``exact`` (the target cannot go
        back) all of ``tokens`` or none."""
        common = 0
        for held, new in zip(self.tokens, prompt[:-1]):
            if held != new:
                break
            common += 1
        if speculative:
            common = min(common, self.draft_rows + (self.pending.count if self.pending else 0))
        return 0 if exact and common < len(self.tokens) else common
