"""What one request asks for, checked in one place."""
from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.decoding.stop_strings import StopStrings

MAX_LOGPROBS = 20   # alternatives per token, at most (OpenAI's ``top_logprobs`` bound, vLLM's default)


@dataclass
class Params:
    """A request's options (``Decoding``'s of the same names); ``check`` refuses a bad one in one
    line. ``logprobs``: each generated token's log-probability under the target and its
    ``logprobs`` most likely alternatives (None: none); ``prompt_logprobs`` the same for every prompt
    token after the first."""
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    speculative: bool = True
    stop: StopStrings | None = None
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty, self.presence_penalty, self.frequency_penalty) != (1, 0, 0)

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens}: expected at least 1")
        if not 0 <= self.temperature <= 2:   # OpenAI's range, the server's and every command's
            raise ValueError(f"temperature {self.temperature}: expected 0 .. 2 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p}: expected more than 0 and at most 1")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k {self.top_k}: expected a whole number, at least 0 (0: every token)")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty {self.repetition_penalty}: expected a finite number "
                             f"above 0 (1: off)")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p {self.min_p}: expected 0 (off) .. 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} {getattr(self, name)}: expected -2 .. 2 (0: off)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} {value}: expected 0 .. {MAX_LOGPROBS} alternatives per token")
