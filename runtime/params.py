"""What one request asks for, checked in one place."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .stop_strings import StopStrings


@dataclass
class Params:
    """A request's options (``Decoding``'s of the same names); ``check`` refuses a bad one in one
    line."""
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    speculative: bool = True
    stop: StopStrings | None = None
    repetition_penalty: float = 1.0

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens}: expected at least 1")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature {self.temperature}: expected a finite number, at least 0 "
                             f"(0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p}: expected more than 0 and at most 1")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k {self.top_k}: expected a whole number, at least 0 (0: every token)")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty {self.repetition_penalty}: expected a finite number "
                             f"above 0 (1: off)")
